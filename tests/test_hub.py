"""Hugging Face Hub IDs as checkpoints, offline, against a cache this test lays out the way huggingface_hub does
(``$HF_HOME/hub/models--ORG--NAME/{refs/main, snapshots/COMMIT/...}``)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qtool.errors import CheckpointError, UsageError
from qtool.model.hub import looks_like_hub_id, resolve_checkpoint
from tests.helpers import tiny_llama

pytest.importorskip("huggingface_hub")
REPO = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf")
    model = tiny_llama(home / "src")
    repo = home / "hub" / "models--qtool-test--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(model, repo / "snapshots" / COMMIT)
    return home


def _qtool(home, *args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-m", "qtool", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def test_a_hub_id_calibrates_and_exports_from_the_cache(hf_home, tmp_path):
    r = _qtool(hf_home, "quantize", "qtool-test/tiny-llama", "-c", "w8a16", "-o", tmp_path / "q", "--json")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "q" / "calibration" / "manifest.json").read_text())
    ckpt = manifest["inputs"]["checkpoint"]
    assert ckpt["hub"] == {"repo_id": "qtool-test/tiny-llama", "revision": "main", "commit": COMMIT}
    assert Path(ckpt["path"]).name == COMMIT and any(k.endswith("model.safetensors") for k in ckpt["sha256"])
    export_manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert export_manifest["inputs"]["checkpoint"]["hub"]["commit"] == COMMIT


def test_config_show_resolves_a_hub_id_at_a_revision(hf_home):
    """config show --model took a Hub ID but no --revision, which every other command reading a model has."""
    r = _qtool(hf_home, "config", "show", "w8a16", "--model", "qtool-test/tiny-llama", "--revision", COMMIT, "--json")
    assert r.returncode == 0, r.stderr
    assert "model.layers.0.mlp.down_proj.weight" in {q["name"] for q in json.loads(r.stdout)["quantizers"]}
    r = _qtool(hf_home, "config", "show", "w8a16", "--model", "qtool-test/tiny-llama", "--revision", "v2")
    assert r.returncode == 2 and "revision 'v2' not in the Hugging Face cache" in r.stderr, r.stderr
    r = _qtool(hf_home, "config", "show", "w8a16", "--revision", "v2")
    assert r.returncode == 2 and "--revision names a version of the --model Hub ID" in r.stderr, r.stderr


def test_eval_takes_a_hub_id_as_its_reference(hf_home, tmp_path):
    """eval -r ORG/NAME read the Hub ID as a local path ('not found')."""
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    r = _qtool(hf_home, "quantize", "qtool-test/tiny-llama", "-c", "w8a16", "-o", tmp_path / "q", "--quiet")
    assert r.returncode == 0, r.stderr
    r = _qtool(hf_home, "eval", tmp_path / "q", "-r", "qtool-test/tiny-llama", "--revision", COMMIT, "--data",
               tmp_path / "ids.safetensors", "--generate", "0", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["export_gap"]["kl_mean"] < 1e-6
    r = _qtool(hf_home, "eval", tmp_path / "q", "--revision", "v2", "--data", tmp_path / "ids.safetensors")
    assert r.returncode == 2 and "--revision names a version of the --reference Hub ID" in r.stderr, r.stderr


def test_offline_and_not_cached_is_one_clear_line(hf_home, tmp_path):
    r = _qtool(hf_home, "calibrate", "qtool-test/not-there", "-c", "w8a16", "-o", tmp_path / "c")
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: qtool-test/not-there: not in the Hugging Face cache") and len(lines) <= 2
    assert not (tmp_path / "c").exists()
    # a cached repository at a revision the cache lacks: the line named the repository only
    r = _qtool(hf_home, "calibrate", "qtool-test/tiny-llama", "--revision", "v2", "-c", "w8a16", "-o", tmp_path / "c")
    assert r.returncode == 2 and "error: qtool-test/tiny-llama: revision 'v2' not in the Hugging Face cache" in r.stderr
    # a mistyped path under a directory that exists here read as a Hub ID only
    r = _qtool(hf_home, "calibrate", "tests/no-such-model", "-c", "w8a16", "-o", tmp_path / "c")
    assert r.returncode == 2 and ("error: tests/no-such-model: no such file or directory in tests, and not in the "
                                  "Hugging Face cache") in r.stderr


def test_a_missing_path_is_not_called_an_unknown_type(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        resolve_checkpoint(str(tmp_path / "nope.safetensors"))
    with pytest.raises(UsageError, match="--revision applies to a Hugging Face Hub ID"):
        resolve_checkpoint(str(tmp_path), revision="v1")
    with pytest.raises(UsageError, match="CHECKPOINT is empty"):  # (it was the working directory)
        resolve_checkpoint("")
    # in Python a Hub ID is no path: run_calibrate said "unknown checkpoint type (no suffix)"
    from qtool.pipeline import CalibrateOptions, load_calibrated, run_calibrate

    for call in (lambda: run_calibrate("qtool-test/nope", "w8a16", str(tmp_path / "o"), CalibrateOptions()),
                 lambda: load_calibrated("qtool-test/nope", str(tmp_path / "e.json"))):
        with pytest.raises(CheckpointError, match=r"qtool-test/nope: checkpoint not found \(no such file or directory; "
                                                  r"for a Hugging Face Hub ID, qtool.model.hub.resolve_checkpoint"):
            call()


@pytest.mark.parametrize("arg, hub", [("org/name", True), ("HuggingFaceTB/SmolLM2-135M", True),
                                      ("runs/model.safetensors", False), ("a/b/c", False), ("name", False),
                                      ("../x", False)])
def test_what_counts_as_a_hub_id(arg, hub):
    assert looks_like_hub_id(arg) is hub


def test_resolve_checkpoint_takes_a_path_and_names_a_wrong_type(tmp_path):
    """A Path (as every job takes) and None raised "AttributeError: 'PosixPath' object has no attribute 'strip'"."""
    assert resolve_checkpoint(tmp_path) == str(tmp_path)
    with pytest.raises(UsageError, match="the checkpoint is a path or a Hub ID string \\(got NoneType\\)"):
        resolve_checkpoint(None)
    with pytest.raises(UsageError, match="revision is a branch, tag or commit string \\(got int\\)"):
        resolve_checkpoint("org/name", revision=5)
