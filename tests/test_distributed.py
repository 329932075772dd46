"""Data-parallel calibration (``torchrun … qtool calibrate``, gloo on CPU): the same bytes as one process, and a
failing rank ends every rank cleanly.

The multi-process runs start real processes the way users do (``python -m torch.distributed.run``); their ranks
get different string-hash seeds (Python randomizes them per process), so a collective ordered by a ``set`` would
desynchronize and these tests would hang or differ.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers import run_cli, tiny_llama

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

# every analyzer at once (activation histograms, min-max; weights: activation-weighted MSE + GPTQ, plain MSE)
MIXED = """version: 1
defaults:
  weights: {bitwidth: 4, symmetric: true, granularity: per_block, block_size: 16,
            analyzer: {name: mse, weighting: activations}, rounding: gptq}
  activations: {inputs: true, outputs: true, analyzer: minmax}
layers:
  - match: "re:.*q_proj"
    activations: {analyzer: percentile}
  - match: "re:.*k_proj"
    activations: {analyzer: sqnr}
  - match: "re:.*mlp.*"
    activations: {analyzer: tf_enhanced}
  - match: "re:.*o_proj"
    weights: {analyzer: mse, rounding: nearest}
ignore: ["lm_head"]
"""


def _torchrun(nproc, *args, env=None, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "qtool", *[str(a) for a in args]]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return r.returncode, r.stdout, r.stderr


def _ours(stderr):
    """The lines qtool printed (torchrun adds its own warnings and failure report)."""
    return [line for line in stderr.splitlines() if line.startswith(("error:", "internal error:", "interrupted:"))]


def _by_hand(commands, env=None, cwds=None):
    """Ranks launched without torchrun, as docs/distributed.md's CI recipe does: rank r runs ``commands[r]`` (an
    argv) with the process group's variables set, ``env`` added, in ``cwds[r]`` (default: the repository)."""
    port = _free_port()
    return [subprocess.Popen([str(c) for c in argv], cwd=(cwds or {}).get(rank, ROOT), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE,
                             text=True,
                             env={**os.environ, "WORLD_SIZE": str(len(commands)), "RANK": str(rank),
                                  "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                  "QTOOL_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1", **(env or {})})
            for rank, argv in enumerate(commands)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist")
    tiny_llama(d / "m")
    ids = torch.randint(0, 256, (14, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[3, 10:] = 0
    save_file({"input_ids": ids, "attention_mask": mask}, d / "ids.safetensors")
    (d / "mixed.yaml").write_text(MIXED)
    return d


def _outputs(run_dir: Path):
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir()) if p.name != "manifest.json"}


@pytest.mark.parametrize("nproc,sequential", [(2, False), (3, True)], ids=["2-ranks", "3-ranks-sequential"])
def test_ranks_write_the_bytes_of_one_process(llama, tmp_path, nproc, sequential):
    """Every analyzer (min-max, percentile, SQNR, TF-enhanced on activations; weighted and plain MSE, GPTQ on
    weights): encodings.json and codes.safetensors are byte-identical to one process, shards of unequal size."""
    args = ["calibrate", llama / "m", "-c", llama / "mixed.yaml", "--data", llama / "ids.safetensors",
            "--batch-size", "2", "--quiet"] + (["--sequential"] if sequential else [])
    code, _, err = run_cli(*args, "-o", tmp_path / "one")
    assert code == 0, err
    code, out, err = _torchrun(nproc, *args, "-o", tmp_path / "many")
    assert code == 0, err
    assert _ours(err) == [] and out == ""  # rank 0 is quiet (--quiet), the others always are
    one, many = _outputs(tmp_path / "one"), _outputs(tmp_path / "many")
    assert set(one) == {"encodings.json", "codes.safetensors"}
    assert many == one
    manifest = json.loads((tmp_path / "many/manifest.json").read_text())
    batches = [2] * 7  # 14 samples in batches of 2, contiguous shards
    per_rank = [sum(batches[len(batches) * r // nproc:len(batches) * (r + 1) // nproc]) for r in range(nproc)]
    assert manifest["distributed"] == {"world_size": nproc, "backend": "gloo", "samples_per_rank": per_rank}
    assert sum(per_rank) == 14 and len(set(per_rank)) > 1


def test_a_cnn_with_folds_and_convolution_gptq_gives_the_bytes_of_one_process(tmp_path):
    """Batch-norm folds (checked on the first batch on every rank), depthwise and pointwise convolution GPTQ from
    patch statistics summed over the ranks, and the shipped w8a8 recipe's activations: the same files."""
    from tests.tinymodels import bnnet

    save_file(bnnet().state_dict(), tmp_path / "bn.safetensors")
    x = torch.randn(20, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    save_file({"x": x}, tmp_path / "x.safetensors")
    recipe = tmp_path / "cnn.yaml"
    recipe.write_text((ROOT / "configs/w8a8.yaml").read_text() + "fold_batch_norms: true\n")
    args = ["calibrate", tmp_path / "bn.safetensors", "-c", recipe, "--model-class", "tests.tinymodels:bnnet",
            "--data", tmp_path / "x.safetensors", "--batch-size", "4", "--quiet"]
    code, _, err = run_cli(*args, "-o", tmp_path / "one")
    assert code == 0, err
    code, _, err = _torchrun(2, *args, "-o", tmp_path / "many")
    assert code == 0, err
    one, many = _outputs(tmp_path / "one"), _outputs(tmp_path / "many")
    assert set(one) == {"encodings.json", "codes.safetensors"} and many == one
    assert len(json.loads((tmp_path / "many/manifest.json").read_text())["batch_norm_folds"]) == 3


def test_weight_only_streaming_splits_weights_over_ranks(tmp_path):
    """No data, a weight-only recipe on an HF directory: the streamed mode, weights split over two ranks, with
    the large block encodings in the sidecar written by rank 0 in plan order."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=4096, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "wide")
    recipe = tmp_path / "w.yaml"
    recipe.write_text("version: 1\ndefaults:\n  weights: {bitwidth: 4, symmetric: false, granularity: per_block, "
                      "block_size: 2}\n  activations: null\n")
    code, _, err = run_cli("calibrate", tmp_path / "wide", "-c", recipe, "-o", tmp_path / "one", "--quiet")
    assert code == 0, err
    code, _, err = _torchrun(2, "calibrate", tmp_path / "wide", "-c", recipe, "-o", tmp_path / "many", "--quiet")
    assert code == 0, err
    one, many = _outputs(tmp_path / "one"), _outputs(tmp_path / "many")
    assert "encodings.safetensors" in one  # block encodings above the inline limit went to the sidecar
    assert many == one


def test_a_failing_rank_stops_every_rank_with_one_line(llama, tmp_path):
    """Bad data in rank 1's shard only (a token id beyond the vocabulary in the last sample): rank 1 says so in
    one line, rank 0 stops quietly with the same status, nothing is written."""
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(2))
    ids[7, 3] = 5000
    save_file({"input_ids": ids}, tmp_path / "bad.safetensors")
    code, out, err = _torchrun(2, "calibrate", llama / "m", "-c", "w8a8", "--data", tmp_path / "bad.safetensors",
                               "--batch-size", "2", "-o", tmp_path / "run", "--quiet")
    assert code != 0
    assert _ours(err) == [f"error: rank 1: {tmp_path / 'bad.safetensors'}: calibration batch 4: the model rejected "
                          "the data: token id 5000 is past "
                          "the model's vocabulary (256 embeddings): the tokenizer (or the id file) belongs to another "
                          "model"]
    assert "exitcode  : 2" in err  # the failing rank's own exit code, as torchrun reports it
    assert not (tmp_path / "run").exists() and not any(p.name.startswith(".run") for p in tmp_path.iterdir())


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_killed_rank_ends_the_others_with_exit_4(llama, tmp_path):
    """Without torchrun's agent to clean up: rank 1 dies (SIGKILL) in the middle of calibration; rank 0 loses
    contact, says so in one line and exits 4 well within the timeout, and nothing is written."""
    from tests.tinymodels import dies_on_rank

    save_file({"x": torch.randn(16, 64)}, tmp_path / "x.safetensors")
    save_file(dies_on_rank().state_dict(), tmp_path / "m.safetensors")
    argv = [sys.executable, "-m", "qtool", "calibrate", tmp_path / "m.safetensors", "--model-class",
            "tests.tinymodels:dies_on_rank", "-c", "w8a8", "--data", tmp_path / "x.safetensors", "--batch-size", "2",
            "-o", tmp_path / "run", "--quiet"]
    procs = _by_hand([argv, argv], {"QTOOL_TEST_DIE_ON_RANK": "1"})
    results = [p.communicate(timeout=120) for p in procs]
    assert procs[1].returncode == -9
    assert procs[0].returncode == 4, results[0][1]
    lines = [line for line in results[0][1].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: lost contact with the other ranks"), lines
    assert "nothing was written" in lines[0]
    assert not (tmp_path / "run").exists()


def test_ranks_launched_with_other_options_are_refused_by_rank_0(llama, tmp_path):
    """A launch script giving each rank its own arguments: other --batch-size values wrote encodings of a sample
    set no rank chose (exit 0, one sample never seen); other recipes hung to the timeout."""
    argv = [sys.executable, "-m", "qtool", "calibrate", llama / "m", "-c", "w8a8", "--data", llama / "ids.safetensors",
            "-o", tmp_path / "run", "--quiet", "--batch-size"]
    procs = _by_hand([argv + ["2"], argv + ["7"]])
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert _ours(errs[0]) == ["error: rank 0: launched with another --batch-size than rank 1 (rank 0: 2; rank 1: "
                              "7): every rank must run the same command"], errs
    assert not _ours(errs[1]) and not (tmp_path / "run").exists()


def test_ranks_given_other_checkpoints_are_refused_and_copies_are_not(llama, tmp_path):
    """A node's stale copy of a re-saved model (same names and shapes, other weights) gave rank 1 other statistics
    to merge, exit 0; a copy with the same bytes at another path (a node-local cache) is the same model."""
    import shutil

    from safetensors.torch import load_file

    copy, stale = tmp_path / "copy", tmp_path / "stale"
    shutil.copytree(llama / "m", copy)
    (copy / "README.md").write_text("a node's own notes beside the same weights\n")  # (not read: not compared)
    shutil.copytree(llama / "m", stale)
    weights = load_file(stale / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"] *= 1.5
    save_file(weights, stale / "model.safetensors", metadata={"format": "pt"})
    assert (stale / "model.safetensors").stat().st_size == (llama / "m" / "model.safetensors").stat().st_size

    def argv(ckpt, out):
        return [sys.executable, "-m", "qtool", "calibrate", ckpt, "-c", "w8a8", "--data", llama / "ids.safetensors",
                "--batch-size", "2", "-o", tmp_path / out, "--quiet"]

    procs = _by_hand([argv(llama / "m", "bad"), argv(stale, "bad")])
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    (line,) = _ours(errs[0])
    assert line.startswith("error: rank 0: launched with another checkpoint's bytes than rank 1 (rank 0: 'sampled "
                           "sha256 "), line
    assert not (tmp_path / "bad").exists()
    procs = _by_hand([argv(llama / "m", "good"), argv(copy, "good")])
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert (tmp_path / "good" / "encodings.json").is_file()


def test_report_ranks_compare_the_encodings_by_their_bytes(llama, tmp_path):
    """Each rank in its own directory with its own c/encodings.json (calibrated on other data): compared by the
    path as given, the ranks merged a report of two calibrations, exit 0."""
    import shutil

    for rank, seed in ((0, 1), (1, 2)):
        ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(seed))
        save_file({"input_ids": ids}, tmp_path / f"ids{rank}.safetensors")
        code, _, err = run_cli("calibrate", llama / "m", "-c", "w8a8", "--data", tmp_path / f"ids{rank}.safetensors",
                               "-o", tmp_path / f"n{rank}" / "c", "--quiet")
        assert code == 0, err
    argv = [sys.executable, "-m", "qtool", "report", llama / "m", "-e", "c/encodings.json", "--data",
            llama / "ids.safetensors", "--json"]
    procs = _by_hand([argv, argv], cwds={0: tmp_path / "n0", 1: tmp_path / "n1"})
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert "launched with another --encodings's bytes than rank 1" in _ours(errs[0])[0], errs
    shutil.copytree(tmp_path / "n0" / "c", tmp_path / "n1" / "c", dirs_exist_ok=True)  # the same bytes: one report
    procs = _by_hand([argv, argv], cwds={0: tmp_path / "n0", 1: tmp_path / "n1"})
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs


def test_the_sampled_hash_reads_a_files_first_middle_and_last_mib(tmp_path):
    from qtool.io.fs import sampled_sha256

    def digest(at=None):
        data = bytearray(8 << 20)
        if at is not None:
            data[at] = 1
        (tmp_path / "w.safetensors").write_bytes(bytes(data))
        return sampled_sha256([tmp_path / "w.safetensors"])

    same = digest()
    assert digest(0) != same and digest(4 << 20) != same and digest((8 << 20) - 1) != same
    assert digest(6 << 20) == same  # (between the samples: the documented limit, cheap on many GB)


FAIL_AFTER_CALIBRATED = """
import sys, time
sys.path.insert(0, {root!r})
from qtool.parallel import from_environment

g = from_environment("cpu")
t0 = time.perf_counter()
try:
    g.calibrated(last={last})
    if g.rank == 0:
        raise ValueError("rank 0 could not write a candidate's files")
    g.all_gather(1)  # where a size-budget search meets rank 0 again (its files are shared next)
    print("no failure seen")
except BaseException as e:
    err = g.abort(e)
    print(type(err).__name__, getattr(err, "rank", ""), round(time.perf_counter() - t0))
finally:
    g.close()
"""


def test_a_rank_failing_after_an_intermediate_calibration_reaches_the_others_at_once(tmp_path):
    """A size-budget search meets rank 0 again after each candidate's calibration (calibrated(last=False)): when
    rank 0 fails while writing that calibration, the others hear it at their next step, in seconds, as a
    PeerFailed naming rank 0 (reported on the finish group instead, they would wait out the timeout)."""
    procs = _by_hand([[sys.executable, "-c", FAIL_AFTER_CALIBRATED.format(root=str(ROOT), last=False)]] * 2)
    outs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert outs[0][0] == "ValueError" and outs[1][:2] == ["PeerFailed", "0"], outs
    assert int(outs[1][2]) < 30, outs  # well within the 60 s timeout


LOST_AFTER_WRITING = """
import os, sys, time
sys.path.insert(0, {root!r})
from qtool.parallel import from_environment

g = from_environment("cpu")
g.calibrated()
if g.rank == 1:
    os._exit(9)  # (killed while rank 0 writes the output)
time.sleep(2)
try:
    g.finish()
except BaseException as e:
    print(type(e).__name__, "|", e)
"""


def test_a_rank_lost_after_rank_0_wrote_the_output_is_not_called_nothing_written(tmp_path):
    """Another rank killed while rank 0 exported: rank 0 said "nothing was written" (exit 4) over a whole output,
    and a retry that believed it met "already exists"."""
    procs = _by_hand([[sys.executable, "-c", LOST_AFTER_WRITING.format(root=str(ROOT))]] * 2)
    out = procs[0].communicate(timeout=120)[0]
    procs[1].communicate(timeout=120)
    assert out.startswith("PeerLost | ") and "the output was written whole before this" in out, out
    assert "nothing was written" not in out


def test_collectives_name_quantizers_in_sorted_order(llama, tmp_path):
    """What each step exchanges is keyed in sorted name order and the steps come in the same sequence on every
    rank whatever the hash seed: recorded on rank 0 of a pretend two-rank group in two processes."""
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT)!r})
import qtool.parallel as P
from qtool.calibration import CalibrateOptions, calibrate_checkpoint
from qtool.config import load_recipe

steps = []
class Pretend(P.Group):
    rank, world_size = 0, 2
    def owned(self, owners):  # this pretend rank 0 does every rank's share, so "rank 1" holds the same values
        return list(range(len(owners)))
    def all_gather(self, value):
        steps.append(("all_gather", list(value) if isinstance(value, dict) else type(value).__name__))
        return [value, value]
    def gather(self, value):
        steps.append(("gather", list(value) if isinstance(value, dict) else type(value).__name__))
        return [value, value]

opts = CalibrateOptions(data={str(llama / 'ids.safetensors')!r}, batch_size=2, sequential=True)
calibrate_checkpoint({str(llama / 'm')!r}, load_recipe({str(llama / 'mixed.yaml')!r}), "mixed", opts, None,
                     group=Pretend())
print(json.dumps(steps))
"""
    runs = []
    for seed in ("1", "2"):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONHASHSEED": seed}, timeout=240)
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1]
    assert len(runs[0]) >= 10  # per block: input sums, weight ranges, GPTQ codes, activation statistics
    for kind, keys in runs[0]:
        if isinstance(keys, list):
            assert keys == sorted(keys), (kind, keys)


def test_report_on_ranks_equals_one_process(llama, tmp_path):
    """``torchrun … qtool report --json``: each rank measures its shard, the sums are folded in global batch
    order, and rank 0 prints exactly the one-process report (the only stdout)."""
    code, _, err = run_cli("calibrate", llama / "m", "-c", "w8a8", "--data", llama / "ids.safetensors",
                           "--batch-size", "2", "-o", tmp_path / "run", "--quiet")
    assert code == 0, err
    args = ["report", llama / "m", "-e", tmp_path / "run/encodings.json", "--data", llama / "ids.safetensors",
            "--batch-size", "2", "--json"]
    code, one, err = run_cli(*args)
    assert code == 0, err
    code, many, err = _torchrun(2, *args)
    assert code == 0, err
    assert json.loads(many) == json.loads(one)
    assert json.loads(one)["end_to_end"]["perplexity_float"] > 1


FLOAT_MIX = """version: 1
defaults:
  weights: {element: fp4_e2m1, granularity: per_block, block_size: 16, scale_dtype: fp8_e4m3,
            analyzer: {name: mse, weighting: activations}, rounding: gptq}
  activations: {element: fp4_e2m1, granularity: per_block, block_size: 16, scale_dtype: fp8_e4m3, dynamic: true}
layers:
  - match: "re:.*mlp.*"
    weights: {element: fp8_e4m3, granularity: per_channel, analyzer: minmax}
    activations: {element: fp8_e4m3, granularity: per_tensor, dynamic: false}
ignore: ["lm_head"]
kv_cache: {granularity: per_head}
"""


def _one_and_two_ranks(llama, tmp_path, recipe: str, *flags):
    """The outputs (manifest aside) of one process and of two ranks calibrating ``recipe`` on the tiny Llama."""
    (tmp_path / "recipe.yaml").write_text(recipe)
    args = ["calibrate", llama / "m", "-c", tmp_path / "recipe.yaml", "--data", llama / "ids.safetensors",
            "--batch-size", "2", "--quiet", *flags]
    code, _, err = run_cli(*args, "-o", tmp_path / "one")
    assert code == 0, err
    code, out, err = _torchrun(2, *args, "-o", tmp_path / "many")
    assert code == 0, err
    return _outputs(tmp_path / "one"), _outputs(tmp_path / "many")


def test_float_grids_on_ranks_write_the_bytes_of_one_process(llama, tmp_path):
    """NVFP4 with shared fused global scales, weighted MSE and GPTQ, NVFP4 activation global scales, FP8 weights
    and static FP8 inputs, FP8 KV-cache scales: two ranks give one process's bytes."""
    one, many = _one_and_two_ranks(llama, tmp_path, FLOAT_MIX)
    assert many == one


ROTATED = """version: 1
defaults:
  weights: {bitwidth: 4, granularity: per_block, block_size: 16, analyzer: mse, rounding: gptq}
  activations: {bitwidth: 8, granularity: per_token, dynamic: true}
layers:
  - {type: Embedding, weights: null, activations: null}
ignore: ["lm_head"]
rotate: {rotations: [r1, r2, r3, r4], type: random-hadamard, seed: 5}
kv_cache: {granularity: per_head}
"""


def test_a_rotated_model_on_ranks_writes_the_bytes_of_one_process(llama, tmp_path):
    """Every rank fuses the same rotations (r4 online, so GPTQ sees rotated inputs; r3 online, so the KV cache
    ranges merged across ranks are of rotated keys) before GPTQ: two ranks give one process's codes, rotated floats
    and KV cache scales."""
    one, many = _one_and_two_ranks(llama, tmp_path, ROTATED)
    assert set(one) == {"encodings.json", "codes.safetensors"} and many == one


AWQ_GPTQ = """version: 1
defaults:
  weights: {bitwidth: 4, symmetric: false, granularity: per_block, block_size: 16, rounding: gptq}
  activations: null
ignore: ["lm_head", "re:.*embed_tokens"]
awq: {grid: 8, objective: %s}
"""


@pytest.mark.parametrize("objective,flags", [("layers", ()), ("outputs", ("--sequential",)),
                                             ("layers", ("--sequential", "--batch-size", "14"))])
def test_awq_then_gptq_on_ranks_writes_the_bytes_of_one_process(llama, tmp_path, objective, flags):
    """AWQ's scales come from the group inputs' XᵀX summed over the ranks, or from each batch's parent-module
    error gathered and added in batch order, so every rank folds the same scales before GPTQ: two ranks give one
    process's folded floats and codes. With one batch, rank 1 has none: --sequential AWQ's check of the block's
    output on a rank's first input was an IndexError there (exit 3)."""
    one, many = _one_and_two_ranks(llama, tmp_path, AWQ_GPTQ % objective, *flags)
    assert set(one) == {"encodings.json", "codes.safetensors"} and many == one
    manifest = json.loads((tmp_path / "many" / "manifest.json").read_text())
    assert any(g["ratio"] is not None for g in manifest["awq"]["groups"])


def test_a_size_budget_search_on_ranks_writes_the_bytes_of_one_process(llama, tmp_path):
    """--target-bpw under torchrun: every candidate calibrates across the ranks, each rank loads rank 0's files and
    measures its share of the search samples (3 batches over 2 ranks), and all get the same choice: recipe.yaml,
    search.json and the chosen model's encodings and codes are one process's bytes."""
    args = ["calibrate", llama / "m", "--data", llama / "ids.safetensors", "--candidates", "w4a16-block32-gptq,w8a16",
            "--target-bpw", "11.5", "--search-samples", "6", "--batch-size", "2", "--quiet"]
    code, _, err = run_cli(*args, "-o", tmp_path / "one")
    assert code == 0, err
    code, _, err = _torchrun(2, *args, "-o", tmp_path / "many")
    assert code == 0, err
    one, many = _outputs(tmp_path / "one"), _outputs(tmp_path / "many")
    assert {"recipe.yaml", "search.json", "encodings.json", "codes.safetensors"} <= set(one) and many == one
    chosen = json.loads(one["search.json"])["chosen"]
    assert all(n > 0 for n in chosen["groups"].values()), chosen  # a real mix of both candidates
    manifest = json.loads((tmp_path / "many" / "manifest.json").read_text())
    assert manifest["distributed"]["world_size"] == 2
    # written before the chosen model was measured
    assert manifest["target"]["chosen"] == {k: v for k, v in chosen.items() if k not in ("damage", "perplexity")}
    assert chosen["perplexity"] > 1


def test_quantize_with_a_size_budget_on_ranks_exports_the_bytes_of_one_process(llama, tmp_path):
    """The same search under ``quantize``: rank 0 exports the chosen model; the file is one process's."""
    args = ["quantize", llama / "m", "--data", llama / "ids.safetensors", "--candidates", "w4a16-block32-gptq,w8a16",
            "--target-bpw", "11.5", "--search-samples", "4", "--batch-size", "2", "-f", "qtool", "--quiet"]
    code, _, err = run_cli(*args, "-o", tmp_path / "one")
    assert code == 0, err
    code, _, err = _torchrun(2, *args, "-o", tmp_path / "many")
    assert code == 0, err
    for name in ("model.safetensors", "recipe.yaml", "calibration/encodings.json", "calibration/search.json"):
        assert (tmp_path / "many" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name


GGUF_MIX = """version: 1
gguf_mix: q4_k_m
defaults:
  weights: {analyzer: {name: mse, weighting: activations}, rounding: gptq}
  activations: null
"""


def test_a_gguf_mix_with_gptq_on_ranks_writes_the_bytes_of_one_process(llama, tmp_path):
    """llama-quantize's Q4_K_M types, the weighted sub-block search and GPTQ on the quantized grid: two ranks give
    one process's encodings and codes."""
    one, many = _one_and_two_ranks(llama, tmp_path, GGUF_MIX)
    assert set(one) == {"encodings.json", "codes.safetensors"} and many == one


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the message of a machine without CUDA")
def test_ranks_asked_for_cuda_without_a_gpu_get_one_clear_error(monkeypatch):
    """``--device cuda`` under torchrun on a machine with no GPU: a usage error before any group is joined (torch
    would otherwise fail inside ``set_device`` with its own message)."""
    from qtool.errors import UsageError
    from qtool.parallel import from_environment

    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UsageError, match="--device cuda but torch sees no CUDA device"):
        from_environment("cuda")
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_experts_and_per_layer_attention_on_ranks_write_the_bytes_of_one_process(tmp_path, family):
    """GPTQ per expert on the tokens each rank routed to it (statistics summed over the ranks), block by block:
    two ranks write one process's bytes (gpt-oss: experts read as slices of the checkpoint's fused tensors; Gemma 3,
    whose blocks each get their own rotary embeddings, passed the same check once: its family stays in the
    parameters' table for a rerun)."""
    import transformers

    torch.manual_seed(0)
    extra = {"qwen3_moe": dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16),
             "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16),
             "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=6)}[family]
    cfg = transformers.AutoConfig.for_model(family, **{**dict(vocab_size=256, hidden_size=64, intermediate_size=64,
                                                              num_hidden_layers=2, num_attention_heads=4,
                                                              num_key_value_heads=2), **extra})
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(tmp_path / "m")
    ids = torch.randint(0, 256, (8, 24), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids}, tmp_path / "ids.safetensors")
    args = ["calibrate", tmp_path / "m", "-c", "w4a16-block32-gptq", "--data", tmp_path / "ids.safetensors",
            "--batch-size", "2", "--quiet", "--sequential"]
    code, _, err = run_cli(*args, "-o", tmp_path / "one")
    assert code == 0, err
    code, out, err = _torchrun(2, *args, "-o", tmp_path / "many")
    assert code == 0, err
    one, many = _outputs(tmp_path / "one"), _outputs(tmp_path / "many")
    assert set(one) == {"encodings.json", "codes.safetensors"} and many == one


@pytest.mark.parametrize("command", [["export", "m", "-e", "enc.json", "-o", "out"],
                                     ["eval", "out", "--data", "held.txt"],
                                     ["imatrix", "m", "--data", "held.txt", "-o", "i.gguf"],
                                     ["import-encodings", "m", "a.encodings", "-o", "out"],
                                     ["inspect", "out"], ["config", "list"], ["config", "show", "w8a8"],
                                     ["config", "show", "w8a8", "--model", "m"], ["config", "validate", "w8a8"]])
def test_a_command_that_runs_in_one_process_refuses_ranks(monkeypatch, tmp_path, command):
    """torchrun ... export: one rank wrote the output, the other failed on "already exists"; eval --json printed
    two JSON documents; imatrix did the whole work twice; inspect and config printed everything once per rank."""
    monkeypatch.chdir(tmp_path)
    for k, v in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    code, out, err = run_cli(*command, "--json")
    name = " ".join(command[:2]) if command[0] == "config" else command[0]
    assert code == 2 and json.loads(out)["error"] == (f"qtool {name} runs in one process (WORLD_SIZE=2): run it "
                                                      "without torchrun"), (out, err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rank", ["5", "2", "-1", "one"])
def test_a_rank_outside_the_world_is_one_clear_error(monkeypatch, rank):
    """Ranks launched by hand (docs/distributed.md's CI recipe) with a RANK past WORLD_SIZE waited on the store for
    the whole timeout (600 s): refused before any group is joined."""
    from qtool.errors import UsageError
    from qtool.parallel import from_environment

    for k, v in {"WORLD_SIZE": "2", "RANK": rank, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(UsageError, match=r"is not a rank of WORLD_SIZE=2 \(0 to 1\)"):
        from_environment("cpu")
    assert not torch.distributed.is_initialized()


def test_an_error_every_rank_meets_is_said_by_rank_0_before_torchrun_stops_it(llama, tmp_path):
    """A missing --data path: rank 1 (which does not speak) exited first and torchrun's SIGTERM stopped rank 0
    before it printed; 7 runs of 10 ended in 'interrupted: SIGTERM' or nothing at all."""
    code, out, err = _torchrun(2, "calibrate", llama / "m", "-c", "w8a8", "--data", tmp_path / "nope.txt",
                               "-o", tmp_path / "run", "--json")
    assert _ours(err) == [f"error: {tmp_path / 'nope.txt'}: data path not found"], err
    assert json.loads(out)["exit_code"] == 2 and "exitcode  : 2" in err
    assert not (tmp_path / "run").exists()


def test_a_rank_other_than_0_waits_for_rank_0_to_say_an_error_they_share(monkeypatch):
    """(the race above, made certain) the quiet rank waits; the rank that says it, or a rank's own error, does not"""
    import typer

    from qtool.cli import core
    from qtool.errors import DataError

    waited = []
    monkeypatch.setattr(core, "_let_rank_0_speak", lambda: waited.append(os.environ["RANK"]))
    monkeypatch.setenv("WORLD_SIZE", "2")
    for launcher, rank, own in (("torchrun", "1", False), ("torchrun", "0", False), ("torchrun", "1", True),
                                (None, "1", False)):  # (a RANK inherited from elsewhere: nobody to wait for)
        monkeypatch.setenv("RANK", rank)
        if launcher:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
        else:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        e = DataError("nope.txt: data path not found")
        if own:
            e.dist_rank = 1
        with pytest.raises(typer.Exit):
            with core._errors():
                raise e
    assert waited == ["1"]


def test_an_error_rank_0_did_not_meet_is_said_by_the_rank_that_met_it(monkeypatch, capsys):
    """A --data file missing on one node only, or QTOOL_DIST_TIMEOUT=abc in one rank's environment: no rank said
    it (rank 1 left it to rank 0, which never met it; torchrun showed only "exitcode : 2"). Once its wait for rank 0
    runs out (torchrun did not stop it: rank 0 did not fail), rank 1 says it; ranks launched by hand say it at
    once."""
    import typer

    from qtool.cli import core
    from qtool.errors import DataError

    monkeypatch.setattr(core, "_let_rank_0_speak", lambda: True)
    for k, v in {"WORLD_SIZE": "2", "RANK": "1", "TORCHELASTIC_RUN_ID": "test"}.items():
        monkeypatch.setenv(k, v)
    for launcher in ("torchrun", None):
        if launcher is None:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID")
        with pytest.raises(typer.Exit):
            with core._errors():
                raise DataError("nope.txt: data path not found")
        assert capsys.readouterr().err.strip() == "error: rank 1: nope.txt: data path not found"


def test_a_launch_error_of_a_rank_other_than_0_is_said_by_it(llama, tmp_path):
    """WORLD_SIZE=2 RANK=1 without MASTER_ADDR/MASTER_PORT exited 2 without a word (only rank 0 spoke)."""
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for k in ("MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "qtool", "calibrate", str(llama / "m"), "-c", "w8a16", "-o",
                        str(tmp_path / "x")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: rank 1: WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT is not set: launch with torchrun "
        "(docs/distributed.md)"), r.stderr


@pytest.mark.parametrize("world", ["0", "-1"])
def test_a_world_size_below_one_is_refused(monkeypatch, world):
    from qtool.errors import UsageError
    from qtool.parallel import from_environment

    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(UsageError, match=r"is not a number of processes \(1 or more\)"):
        from_environment("cpu")


def test_a_full_disk_on_one_rank_is_exit_2_not_an_internal_error():
    """An OSError on one rank reached the others as 'internal error: OSError ...', exit 3."""
    import errno

    from qtool.parallel import _describe

    code, text = _describe(OSError(errno.ENOSPC, "No space left on device", "/out.resume/block-1.safetensors"))
    assert (code, text) == (2, "/out.resume/block-1.safetensors: No space left on device")


def test_a_bad_flag_under_torchrun_is_said_once(llama, tmp_path):
    """Every rank parses the flags: the error line came once per rank, and --json put two objects on stdout."""
    code, out, err = _torchrun(2, "calibrate", llama / "m", "-c", "w8a8", "--batch-size", "0", "-o", tmp_path / "x",
                               "--json")
    assert len([line for line in err.splitlines() if line.startswith("error: Invalid value for '--batch-size'")]) == 1
    assert json.loads(out)["exit_code"] == 2, out  # (two objects: json's "Extra data")


@pytest.mark.parametrize("rank, said", [("0", True), ("1", False)])
def test_under_torchrun_an_interrupt_is_said_by_rank_0_alone(monkeypatch, capsys, rank, said):
    """torchrun stops the other ranks with SIGTERM once one fails: a rank that had not yet met the same error printed
    'interrupted: SIGTERM' beside rank 0's line (seen in CI under load)."""
    import typer

    from qtool.cli.core import _errors, _Terminated

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(typer.Exit) as e:
        with _errors():
            raise _Terminated()
    assert e.value.exit_code != 0
    assert ("interrupted: SIGTERM" in capsys.readouterr().err) == said


def test_a_long_message_is_cut_at_a_word_and_an_unbroken_one_keeps_its_start():
    """Lost-contact lines cut gloo's text mid-word; textwrap alone cut one long word to nothing but ' ...'."""
    from qtool.errors import cut

    text = "Connection reset by peer. This is typically caused by a remote peer dying " * 4
    said = cut(text, 160)
    assert len(said) <= 160 and said.endswith(" ...") and said[:-4].split()[-1] in text.split(), said
    assert cut("x" * 170, 160) == "x" * 160 and cut("short", 160) == "short"


def test_a_lost_rank_says_what_a_sequential_run_kept(tmp_path, capsys):
    """The exit-4 line said "nothing was written" where OUT.resume held the finished blocks, which --resume
    continues from (an interrupt's line said so)."""
    import typer

    from qtool.cli.core import _errors
    from qtool.io.fs import resumable
    from qtool.parallel import PeerLost

    state = tmp_path / "out.resume"
    resumable(state)
    lost = PeerLost("lost contact with the other ranks while exchanging statistics (...): closed; nothing was written")
    lost.outcome = "nothing was written"  # (as the group's collective raises it)
    try:
        with pytest.raises(typer.Exit) as e:
            with _errors():
                raise lost
    finally:
        resumable(state, kept=False)
    assert e.value.exit_code == 4
    err = " ".join(capsys.readouterr().err.split())
    assert (f"nothing was written; {state} keeps the blocks finished so far: the same command with --resume "
            "continues") in err, err


@pytest.mark.parametrize("value, accepted", [("1e9", False), ("9999999", True), ("0", False), ("abc", False),
                                             ("2.5", True)])
def test_a_timeout_out_of_range_says_the_range(monkeypatch, value, accepted):
    """QTOOL_DIST_TIMEOUT=1e9 (a number of seconds) read "give the seconds a rank waits", the bound unsaid."""
    from qtool.errors import UsageError
    from qtool.parallel import _timeout_s

    monkeypatch.setenv("QTOOL_DIST_TIMEOUT", value)
    if accepted:
        assert _timeout_s() == float(value)
        return
    with pytest.raises(UsageError, match=r"above 0 and below 10000000 \(about 115 days"):
        _timeout_s()
