"""Fuzz every reader of a file a user hands qtool: N generated inputs per reader (10,000 by default), each a mutation
of a valid file. A reader may accept an input or refuse it with qtool's typed error (exit 2 at the CLI) or an
OSError (exit 2 too); anything else would be exit 3, an internal error, and is counted as a failure, as is an input
that takes longer than --timeout seconds (a hang). Prints a table and writes bench/results/fuzz_readers.json.

    python bench/fuzz_readers.py                      # all readers, 10,000 inputs each (~12 minutes on 2 cores)
    python bench/fuzz_readers.py -n 500 --only recipe # a quick look at one reader

Readers: recipes (bytes and structure), qtool encodings, AIMET files, safetensors checkpoints, Hugging Face
config.json, calibration data, ``qtool inspect`` of any of them, qtool's float exports (FP8/FP4 tensors), imatrix
files, GGUF files, compressed-tensors directories, the Hugging Face files GGUF export reads (config.json and the
tokenizer files) and size-search records (search.json). Before fuzzing, every seed qtool wrote is read back by its
own reader ("writers: N of N"): a writer only writes what its reader accepts.

Writers (--only writer-weights writer-config): tiny Llamas (and an MLP state dict) with hostile weights (NaN, Inf,
1e38, -3e38, beyond float16, subnormals, zeros) or hostile config.json values, through every format's writer
(qtool, ONNX, compressed-tensors, GGUF with f16 fallbacks, AIMET, imatrix): no exit 3, no NaN or infinity in any
written file, no input changed (hashed before and after), nothing written by a refused run. -n applies (at most 200
unless --writer-n says otherwise); see "writers" below.

    python bench/fuzz_readers.py --only writer-weights writer-config -n 60   # ~2 minutes

Mutations are seeded (--seed), so a failure reproduces: the JSON names the reader, the input number and the
exception, and --keep DIR saves each failing input.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qtool.errors import QtoolError  # noqa: E402

# ---------------------------------------------------------------------------------------------------------------
# mutations
# ---------------------------------------------------------------------------------------------------------------
_ODD_VALUES: List[Any] = [
    None, True, False, 0, -1, 1, 2, 7, 16, 17, 64, 2**31, 2**63, 2**64, -(2**63) - 1, 10**400, 0.5, -0.0, 1e-45,
    3.4e38, 1e39, 1e308, "", "false", "true", "0", "8", "nan", "inf", "per_row", "per_block", "x" * 5000,
    "../../etc/passwd", "re:(a+)+b", [], [1], [[]], {}, {"a": 1}, [None], ["x"], [-1, 64], [0, 0], [2**40],
]
_RAW_INSERTS = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b'"\xff\xfe"', b"[" * 5000, b"{", b"}", b"\x00",
                b'"a": 1, "a": 2', b"\xef\xbb\xbf", b"\\ud800", b"&a [1]", b"*a", b"!!python/object:os.system"]


def _odd(rng: random.Random) -> Any:
    return json.loads(json.dumps(rng.choice(_ODD_VALUES)))  # a fresh copy: never share a container between spots


def _walk(obj: Any, rng: random.Random):
    """A random (container, key) inside ``obj`` (None when ``obj`` has no containers)."""
    spots = []

    def visit(o, depth=0):
        if depth > 12:
            return
        if isinstance(o, dict):
            for k in list(o):
                spots.append((o, k))
                visit(o[k], depth + 1)
        elif isinstance(o, list):
            for i in range(min(len(o), 8)):
                spots.append((o, i))
                visit(o[i], depth + 1)

    visit(obj)
    return rng.choice(spots) if spots else None


def mutate_structure(obj: Any, rng: random.Random) -> Any:
    """1-3 changes to a parsed JSON/YAML value: replace, delete, retype, duplicate into, deepen."""
    obj = json.loads(json.dumps(obj))
    for _ in range(rng.randint(1, 3)):
        spot = _walk(obj, rng)
        if spot is None:
            return _odd(rng)
        container, key = spot
        op = rng.random()
        if op < 0.45:
            container[key] = _odd(rng)
        elif op < 0.6:
            del container[key]
        elif op < 0.7:
            container[key] = [container[key]] if rng.random() < 0.5 else {"v": container[key]}
        elif op < 0.8 and isinstance(container, dict):
            container[rng.choice(["extra", "version", "schema", "name", "shape", "min", "dtype"])] = \
                _odd(rng)
        elif op < 0.9 and isinstance(container[key], (int, float)) and not isinstance(container[key], bool):
            try:
                container[key] = container[key] * rng.choice([-1, 0, 1e30, 1e-30, 2**40])
            except OverflowError:  # a huge integer times a float
                container[key] = _odd(rng)
        else:
            container[key] = json.loads(json.dumps(container[key])) if rng.random() < 0.5 else None
    return obj


def mutate_bytes(raw: bytes, rng: random.Random) -> bytes:
    """Byte-level damage: flips, truncation, insertions of hostile tokens, splices."""
    b = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        if not b:
            b += rng.choice(_RAW_INSERTS)
        elif op < 0.3:
            i = rng.randrange(len(b))
            b[i] = rng.randrange(256)
        elif op < 0.5:
            del b[rng.randrange(len(b)):]
        elif op < 0.8:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.choice(_RAW_INSERTS)
        else:
            i, j = sorted(rng.randrange(len(b) + 1) for _ in range(2))
            b[i:i] = b[i:j]
    return bytes(b)


def mutate_json_file(raw: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.65:
        return json.dumps(mutate_structure(json.loads(raw), rng)).encode()
    return mutate_bytes(raw, rng)


def mutate_safetensors(raw: bytes, rng: random.Random) -> bytes:
    """Mostly header edits (the data section kept), sometimes raw damage anywhere."""
    (n,) = struct.unpack("<Q", raw[:8])
    if rng.random() < 0.7:
        header = json.loads(raw[8:8 + n])
        text = json.dumps(mutate_structure(header, rng)).encode()
        if rng.random() < 0.1:
            text = mutate_bytes(text, rng)
        length = len(text) if rng.random() < 0.9 else rng.choice([0, 1, len(text) + 5, 2**63, 2**64 - 1])
        return struct.pack("<Q", length) + text + raw[8 + n:]
    return mutate_bytes(raw, rng)


_ODD_INTS = [0, 1, 2, 3, 31, 32, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


def mutate_gguf(seed, rng: random.Random) -> bytes:
    """Mostly damage to the header (key-value pairs and tensor infos, before the data section ``seed[1]``): an
    integer field (a count, a length, a type, an offset, a dimension) overwritten with an odd value, bytes flipped
    or cut; sometimes raw damage anywhere."""
    raw, head = seed
    if rng.random() < 0.2:
        return mutate_bytes(raw, rng)
    b = bytearray(raw)
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        i = rng.randrange(4, head)
        if op < 0.45:
            width = rng.choice([4, 8])
            value = rng.choice(_ODD_INTS) % (2 ** (8 * width))
            b[i:i + width] = value.to_bytes(width, "little")
        elif op < 0.75:
            b[i] = rng.randrange(256)
        elif op < 0.85:
            del b[i:]
            break
        else:
            j = min(len(b), i + rng.randrange(1, 64))
            b[i:j] = rng.choice(_RAW_INSERTS)
    return bytes(b)


# ---------------------------------------------------------------------------------------------------------------
# the readers, each with its valid seed files
# ---------------------------------------------------------------------------------------------------------------
def _qtool(*args) -> None:
    import subprocess

    r = subprocess.run([sys.executable, "-m", "qtool", *map(str, args), "--quiet"], cwd=REPO, capture_output=True,
                       text=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    if r.returncode != 0:
        raise SystemExit(f"seed step failed: qtool {' '.join(map(str, args))}: {r.stderr.strip()}")


def build_world(d: Path) -> Dict[str, Any]:
    """Valid seed files for every reader, made with qtool itself (a small MLP, tests.tinymodels:mlp)."""
    from tests.tinymodels import mlp

    model = mlp()
    ckpt = d / "model.safetensors"
    save_file(model.state_dict(), ckpt)
    save_file({"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}, d / "seed_data.safetensors")
    seeds: Dict[str, List[bytes]] = {"recipe": [p.read_bytes() for p in sorted((REPO / "configs").glob("*.yaml"))]}
    seeds["encodings"], seeds["aimet"] = [], []
    for recipe in ("w8a8", "w4a16-block32", "w8a8-dynamic", "nvfp4", "mxfp4a16", "fp8"):
        run = d / f"run-{recipe}"
        _qtool("calibrate", ckpt, "-c", recipe, "--model-class", "tests.tinymodels:mlp", "--data",
               d / "seed_data.safetensors", "-o", run)
        seeds["encodings"].append((run / "encodings.json").read_bytes())
    for gguf_type in ("q4_1", "q6_k"):  # GGUF grids: scale_dtype names the type (64-wide rows fall back to Q8_0)
        (d / f"{gguf_type}.yaml").write_text(f"version: 1\ndefaults:\n  weights: {{gguf_type: {gguf_type}}}\n"
                                             "  activations: null\n")
        run = d / f"run-{gguf_type}"
        _qtool("calibrate", ckpt, "-c", d / f"{gguf_type}.yaml", "--model-class", "tests.tinymodels:mlp", "-o", run)
        seeds["encodings"].append((run / "encodings.json").read_bytes())
    for version in ("0.6.1", "1.0.0", "2.0.0"):
        out = d / f"aimet-{version}"
        _qtool("export", ckpt, "-e", d / "run-w8a8" / "encodings.json", "--model-class", "tests.tinymodels:mlp",
               "--format", "aimet", "--encoding-version", version, "-o", out)
        seeds["aimet"].append((out / "model.encodings").read_bytes())
    seeds["float_export"] = []
    for recipe in ("nvfp4a16", "fp8", "mxfp4a16"):  # qtool's own safetensors holding FP8 / packed FP4 / E8M0
        out = d / f"export-{recipe}"
        _qtool("quantize", ckpt, "-c", recipe, "--model-class", "tests.tinymodels:mlp", "--data",
               d / "seed_data.safetensors", "-o", out)
        seeds["float_export"].append((out / "model.safetensors").read_bytes())
    from qtool.imatrix import write_imatrix

    g = torch.Generator().manual_seed(1)
    write_imatrix(d / "imatrix.gguf", {f"blk.{i}.attn_q.weight": [(torch.rand(64, generator=g) * 100, 50)]
                                       for i in range(3)}, ["seed.txt"], 16, 3)
    dat = struct.pack("<i", 2) + b"".join(struct.pack("<i", 19) + f"blk.{i}.ffn_up.weight".encode()[:19]
                                          + struct.pack("<ii", 4, 8) + np.arange(8, dtype="<f4").tobytes()
                                          for i in range(2)) + struct.pack("<ii", 4, 4) + b"seed"
    seeds["imatrix"] = [(d / "imatrix.gguf").read_bytes(), dat]
    seeds["safetensors"] = [ckpt.read_bytes()]
    seeds["hf_config"] = [json.dumps({"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                                      "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "architectures": ["LlamaForCausalLM"],
                                      "tie_word_embeddings": False}).encode()]
    np.save(d / "seed.npy", np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32))
    seeds["data"] = [(d / "seed.npy").read_bytes(), (d / "seed_data.safetensors").read_bytes(),
                     b'{"text": "one"}\n{"text": "two"}\n']
    _llama_seeds(d, seeds)
    return {"model": model, "seeds": seeds, "dir": d,
            "shapes": {k: tuple(v.shape) for k, v in model.state_dict().items()}}


_HF_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _llama_seeds(d: Path, seeds: Dict[str, List[Any]]) -> None:
    """Seeds made from tiny Llamas with a byte-level BPE tokenizer (tests.test_gguf): GGUF files (K-quant mixes on
    256-wide rows, Q8_0 with a tied output), compressed-tensors directories (int, FP8, NVFP4, MXFP4), the Hugging
    Face files GGUF export reads, and a size-budget search record."""
    import gguf
    import transformers

    from tests.test_gguf import VOCAB, _tiny_llama

    transformers.utils.logging.disable_progress_bar()
    wide, narrow = _tiny_llama(d / "wide", False, hidden=256), _tiny_llama(d / "narrow", True)
    ids = torch.randint(1, VOCAB, (8, 16), generator=torch.Generator().manual_seed(2))
    save_file({"input_ids": ids}, d / "ids.safetensors")
    seeds["gguf"] = [(seeds["imatrix"][0], gguf.GGUFReader(d / "imatrix.gguf").data_offset)]
    for model, recipe in ((wide, "gguf-q4_k_m"), (wide, "gguf-q2_k"), (wide, "gguf-iq4_xs"), (narrow, "gguf-q8_0")):
        out = d / f"gguf-{model.name}-{recipe}"
        _qtool("quantize", model, "-c", recipe, "-f", "gguf", "-o", out)
        seeds["gguf"].append(((out / "model.gguf").read_bytes(), gguf.GGUFReader(out / "model.gguf").data_offset))
    seeds["compressed_tensors"] = []
    for recipe in ("w4a16-block32", "w8a8", "fp8", "nvfp4a16", "mxfp4a16"):
        out = d / f"ct-{recipe}"
        _qtool("quantize", narrow, "-c", recipe, "-f", "compressed-tensors", "--data", d / "ids.safetensors",
               "-o", out)
        seeds["compressed_tensors"].append({f: (out / f).read_bytes() for f in ("config.json", "model.safetensors")})
    seeds["hf_gguf"] = [{f: (narrow / f).read_bytes() for f in _HF_FILES if (narrow / f).exists()}]
    out = d / "search"
    _qtool("quantize", narrow, "--data", d / "ids.safetensors", "--candidates", "w4a16-block32,w8a16",
           "--target-bpw", "12", "-o", out)
    seeds["search"] = [(out / "calibration" / "search.json").read_bytes()]


def _read_recipe(path: Path, world) -> None:
    from qtool.config import load_recipe, resolve_plan

    resolve_plan(load_recipe(path), world["model"], source=str(path))


def _read_encodings(path: Path, world) -> None:
    from qtool.encodings import EncodingsFile

    for e in EncodingsFile.read(path).entries:
        if not e.dynamic:
            e.scale_offset()


def _read_aimet(path: Path, world) -> None:
    from qtool.aimet_format import from_aimet, read_aimet

    enc, _ = from_aimet(read_aimet(path), world["shapes"], str(path), lambda n: n.rsplit(".", 1)[0])
    for e in enc.entries:
        e.scale_offset()


def _read_safetensors(path: Path, world) -> None:
    from qtool.io.checkpoint import CheckpointTensors

    tensors = CheckpointTensors(path)
    for k in tensors.keys():
        tensors.get(k)


def _read_hf_config(path: Path, world) -> None:
    from qtool.model.hf import _config

    _config(path.parent, trust_remote_code=False)


def _read_data(path: Path, world) -> None:
    from qtool.data import load_data

    load_data(path, batch_size=4)


def _read_float_export(path: Path, world) -> None:
    from qtool.export.qtool_st import read_integer_export
    from qtool.inspect import inspect_path

    inspect_path(path)
    read_integer_export(path)


def _read_imatrix(path: Path, world) -> None:
    from qtool.imatrix import read_imatrix

    read_imatrix(path)


def _inspect(path: Path, world) -> None:
    from qtool.inspect import inspect_path

    inspect_path(path)


def _read_gguf_file(path: Path, world) -> None:
    from qtool.inspect import inspect_path

    inspect_path(path)


def _read_compressed_tensors(path: Path, world) -> None:
    from qtool.inspect import inspect_path

    inspect_path(path)


def _read_hf_for_gguf(path: Path, world) -> None:
    """What GGUF export reads from a Hugging Face directory: the config (hyperparameters) and the tokenizer files,
    onto a GGUF writer that is never written."""
    import gguf

    from qtool.export.gguf_model import read_gguf_model

    model = read_gguf_model(path)
    model.add_metadata(gguf.GGUFWriter(path / "never-written.gguf", model.arch), 1, 320)


def _read_search(path: Path, world) -> None:
    from qtool.report import pareto_points, read_search

    pareto_points(read_search(path))


def mutate_files(files: Dict[str, bytes], rng: random.Random) -> Dict[str, bytes]:
    """One file of a directory damaged: JSON files as JSON, safetensors files as safetensors."""
    files = dict(files)
    name = rng.choice(sorted(files))
    files[name] = (mutate_safetensors if name.endswith(".safetensors") else mutate_json_file)(files[name], rng)
    return files


# reader -> (seed kind, file name (a directory's when the seed is a dict of files), mutation, call)
READERS: Dict[str, tuple] = {
    "recipe": ("recipe", "r.yaml", mutate_bytes, _read_recipe),
    "recipe-structure": ("recipe", "r.yaml", None, _read_recipe),
    "encodings": ("encodings", "encodings.json", mutate_json_file, _read_encodings),
    "aimet": ("aimet", "model.encodings", mutate_json_file, _read_aimet),
    "safetensors": ("safetensors", "model.safetensors", mutate_safetensors, _read_safetensors),
    "hf-config": ("hf_config", "config.json", mutate_json_file, _read_hf_config),
    "data": ("data", None, None, _read_data),
    "inspect": (None, None, None, _inspect),
    "qtool-float-export": ("float_export", "model.safetensors", mutate_safetensors, _read_float_export),
    "imatrix": ("imatrix", "imatrix.gguf", mutate_bytes, _read_imatrix),
    "gguf": ("gguf", "model.gguf", mutate_gguf, _read_gguf_file),
    "compressed-tensors": ("compressed_tensors", "ct-model", mutate_files, _read_compressed_tensors),
    "hf-for-gguf": ("hf_gguf", "hf-model", mutate_files, _read_hf_for_gguf),
    "search-record": ("search", "search.json", mutate_json_file, _read_search),
}


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def _recipe_structure(raw: bytes, rng: random.Random) -> bytes:
    import yaml

    return yaml.safe_dump(mutate_structure(yaml.safe_load(raw), rng)).encode()


def _input_for(reader: str, world, rng: random.Random):
    """(file name, bytes, call) of one generated input for ``reader``."""
    seeds = world["seeds"]
    if reader == "recipe-structure":
        return "r.yaml", _recipe_structure(rng.choice(seeds["recipe"]), rng), READERS[reader][3]
    if reader == "data":
        i = rng.randrange(3)
        raw = seeds["data"][i]
        name = ("d.npy", "d.safetensors", "d.jsonl")[i]
        body = mutate_safetensors(raw, rng) if i == 1 else mutate_bytes(raw, rng)
        return name, body, _read_data
    if reader == "inspect":
        kind = rng.choice(["encodings", "aimet", "safetensors"])
        name, mutate = READERS[kind][1], READERS[kind][2]
        return name, mutate(rng.choice(seeds[kind]), rng), _inspect
    kind, name, mutate, call = READERS[reader]
    return name, mutate(rng.choice(seeds[kind]), rng), call


def _write_input(path: Path, body) -> Path:
    """``body`` at ``path``: bytes as a file, a dict of name -> bytes as a directory holding only those files."""
    if isinstance(body, dict):
        path.mkdir(exist_ok=True)
        for old in path.iterdir():
            old.unlink()
        for name, data in body.items():
            (path / name).write_bytes(data)
    else:
        path.write_bytes(body)
    return path


def _seed_files(kind: str, world) -> List[Any]:
    """The seed files of ``kind`` as written (GGUF seeds carry their data offset beside the bytes)."""
    return [s[0] if kind == "gguf" else s for s in world["seeds"][kind]]


def check_writers(world) -> List[Dict[str, Any]]:
    """Every writer only writes what its own reader accepts: each unmutated seed (a file qtool wrote, or the input
    it was made from) read by its reader."""
    out = []
    case_dir = world["dir"] / "writers"
    case_dir.mkdir(exist_ok=True)
    for reader, (kind, name, _, call) in READERS.items():
        if kind in (None, "recipe", "data"):  # shipped recipes are for other models; data is not written by qtool
            continue
        for i, body in enumerate(_seed_files(kind, world)):
            (case_dir / f"{reader}-{i}").mkdir()
            try:
                call(_write_input(case_dir / f"{reader}-{i}" / name, body), world)
                out.append({"reader": reader, "seed": i, "ok": True})
            except Exception as e:  # noqa: BLE001 - any refusal of qtool's own output is the finding
                out.append({"reader": reader, "seed": i, "ok": False, "error": f"{type(e).__name__}: {e}"[:200]})
    return out


def fuzz(reader: str, n: int, seed: int, world, timeout: float, keep: Path = None) -> Dict[str, Any]:
    rng = random.Random(f"{seed}-{reader}")
    counts = {"accepted": 0, "refused": 0, "internal": 0, "hang": 0}
    failures: List[Dict[str, Any]] = []
    slowest = 0.0
    case_dir = world["dir"] / f"cases-{reader}"
    case_dir.mkdir(exist_ok=True)
    start = time.perf_counter()
    for i in range(n):
        name, body, call = _input_for(reader, world, rng)
        path = _write_input(case_dir / name, body)
        t0 = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, timeout)
        outcome, detail = "accepted", None
        try:
            call(path, world)
        except (QtoolError, OSError):
            outcome = "refused"
        except _Hang:
            outcome, detail = "hang", f"over {timeout} s"
        except Exception as e:  # exit 3 at the CLI
            outcome = "internal"
            tb = traceback.extract_tb(e.__traceback__)[-1]
            detail = f"{type(e).__name__}: {str(e)[:160]} ({Path(tb.filename).name}:{tb.lineno})"
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        slowest = max(slowest, time.perf_counter() - t0)
        counts[outcome] += 1
        if outcome in ("internal", "hang"):
            failures.append({"input": i, "file": name, "error": detail})
            if keep is not None:
                keep.mkdir(parents=True, exist_ok=True)
                _write_input(keep / f"{reader}-{i}-{name}", body)
    return {"reader": reader, "inputs": n, **counts, "slowest_s": round(slowest, 3),
            "seconds": round(time.perf_counter() - start, 1), "failures": failures[:50]}


# ---------------------------------------------------------------------------------------------------------------
# writers: hostile model inputs (weight magnitudes, config.json values) through every format's writer
# ---------------------------------------------------------------------------------------------------------------
# A writer may write its format or refuse the model with qtool's typed error (exit 2, nothing written). A failure is
# exit 3 (or an exception escaping the CLI, or any exit other than 0 and 2), a NaN or infinity in any file written,
# a changed input (every input file hashed before and after), files left behind by a refused run (or beside OUT),
# a file written that its format's reader cannot open, a run over --writer-timeout seconds (a hang) and a worker
# that died (killed for memory, say: the worker runs under --writer-mem GiB of address space).
#
# Cases run in-process in one worker process (the CLI through typer's CliRunner: ~0.2-1 s a case instead of ~8 s
# of start-up each); the first case of each distinct failure is run again by ``python -m qtool`` in a fresh
# process, so a failure that only shared state made is told apart ("fresh" in the JSON and the list).
# 200 inputs per mutator take about 2-3 minutes on 2 cores (a hang adds --writer-timeout, twice when its fresh
# rerun hangs too: the "hang" kind is not rerun), after about a minute building the seeds and the baseline.
_HOSTILE_WEIGHTS = [float("nan"), float("inf"), float("-inf"), 1e38, -3e38, 65504.0 * 2, 1e-45, 1e-40, 0.0]
_CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "rope_theta",
                "max_position_embeddings"]
_DELETE = object()

# writer path -> (model kind, arguments); {M} the model directory (the MLP's: its state dict), {OUT} the output,
# {IDS} token ids (the Llamas) or features (the MLP)
WRITER_PATHS: Dict[str, tuple] = {
    "qtool w8a16": ("llama", "quantize {M} -c w8a16 -o {OUT}"),
    "qtool nvfp4a16": ("llama", "quantize {M} -c nvfp4a16 -o {OUT}"),
    "onnx w8a8": ("llama", "quantize {M} -c w8a8 --data {IDS} -o {OUT} --format onnx"),
    "onnx w8a8 mlp": ("mlp", "quantize {M} -c w8a8 --model-class tests.tinymodels:mlp --data {IDS} -o {OUT} "
                             "--format onnx"),
    "ct w8a16": ("llama", "quantize {M} -c w8a16 -o {OUT} --format compressed-tensors"),
    "ct fp8-dynamic": ("llama", "quantize {M} -c fp8-dynamic -o {OUT} --format compressed-tensors"),
    "ct nvfp4a16": ("llama", "quantize {M} -c nvfp4a16 -o {OUT} --format compressed-tensors"),
    "gguf q8_0": ("llama", "quantize {M} -c gguf-q8_0 -o {OUT} --format gguf"),
    "gguf q4_k_m": ("llama", "quantize {M} -c gguf-q4_k_m -o {OUT} --format gguf"),
    "gguf fallback f16": ("llama", "quantize {M} -c w8a16 -o {OUT} --format gguf --gguf-fallback f16"),
    "gguf float f16": ("llama", "quantize {M} -c w8a16 -o {OUT} --format gguf --gguf-fallback f16 "
                                "--gguf-float f16"),
    "aimet w8a16": ("llama", "quantize {M} -c w8a16 -o {OUT} --format aimet"),
    "imatrix": ("llama", "imatrix {M} --data {IDS} -o {OUT}/imatrix.gguf"),
}


def _writer_seeds(d: Path) -> Dict[str, List[Path]]:
    """The seed models (directories holding the model and its data): tiny Llamas with a byte-level BPE tokenizer
    (tests.test_gguf: hidden 64 untied and tied, hidden 256 for K-quants' 256-wide rows) with token ids [8, 24],
    and tests.tinymodels:mlp's state dict with features [16, 64]."""
    import transformers

    from tests.test_gguf import VOCAB, _tiny_llama
    from tests.tinymodels import mlp

    transformers.utils.logging.disable_progress_bar()
    seeds: Dict[str, List[Path]] = {"llama": [], "mlp": []}
    for name, tied, hidden in (("untied", False, 64), ("tied", True, 64), ("wide", False, 256)):
        _tiny_llama(d / name / "model", tied, hidden=hidden)
        ids = torch.randint(1, VOCAB, (8, 24), generator=torch.Generator().manual_seed(3))
        save_file({"input_ids": ids}, d / name / "data.safetensors")
        seeds["llama"].append(d / name)
    (d / "mlp" / "model").mkdir(parents=True)
    save_file(mlp().state_dict(), d / "mlp" / "model" / "model.safetensors", metadata={"format": "pt"})
    save_file({"x": torch.randn(16, 64, generator=torch.Generator().manual_seed(0))}, d / "mlp" / "data.safetensors")
    seeds["mlp"].append(d / "mlp")
    return seeds


def mutate_weights(model: Path, rng: random.Random) -> str:
    """1-3 tensors of model.safetensors (an embedding, a projection, a norm, lm_head; any tensor of a state dict)
    with one element, a row, scattered elements or the whole tensor set to NaN, +-Inf, 1e38, -3e38, 131008 (beyond
    float16), a subnormal (1e-45, 1e-40) or 0."""
    from safetensors.torch import load_file

    path = model / "model.safetensors"
    tensors = load_file(str(path))
    groups: Dict[str, List[str]] = {}
    for name in sorted(tensors):
        kind = ("embedding" if "embed" in name else "lm_head" if name.startswith("lm_head") else
                "norm" if "norm" in name else "projection" if "_proj" in name else "tensor")
        groups.setdefault(kind, []).append(name)
    done = []
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(groups[rng.choice(sorted(groups))])
        t, value = tensors[name], rng.choice(_HOSTILE_WEIGHTS)
        where = rng.choice(["element", "row", "scattered", "tensor"])
        if where == "element":
            t.view(-1)[rng.randrange(t.numel())] = value
        elif where == "row":
            (t[rng.randrange(t.shape[0])] if t.dim() > 1 else t).fill_(value)
        elif where == "scattered":
            g = torch.Generator().manual_seed(rng.randrange(2**31))
            t.view(-1)[torch.rand(t.numel(), generator=g) < rng.choice([0.01, 0.1, 0.5])] = value
        else:
            t.fill_(value)
        done.append(f"{name} {where} = {value:g}")
    save_file(tensors, str(path), metadata={"format": "pt"})
    return "; ".join(done)


def _odd_config_value(old: Any, rng: random.Random) -> Any:
    choices: List[Any] = [0, -1, None, True, False, 1e308, float("nan"), float("inf"), "64", 0.5, 2**31, 10**9,
                          _DELETE]
    if isinstance(old, (int, float)) and not isinstance(old, bool):
        choices += [old * 2, old + 1, old - 1, old // 2 if isinstance(old, int) else old / 2, float(old) + 0.5,
                    str(old), -old]
    return rng.choice(choices)


def mutate_config(model: Path, rng: random.Random) -> str:
    """1-2 values of config.json (sizes, layer and head counts, vocabulary, tying, norm epsilon, RoPE base, context)
    changed to a larger or smaller integer, 0, -1, a string, null, a float, 1e308, NaN, infinity, a boolean, or
    deleted."""
    path = model / "config.json"
    cfg = json.loads(path.read_text())
    done = []
    for key in rng.sample(_CONFIG_KEYS, rng.randint(1, 2)):
        holder, label = cfg, key
        if key == "rope_theta" and isinstance(cfg.get("rope_parameters"), dict) and rng.random() < 0.8:
            holder, label = cfg["rope_parameters"], f"rope_parameters.{key}"  # transformers 5 keeps it there
        value = _odd_config_value(holder.get(key), rng)
        if value is _DELETE:
            holder.pop(key, None)
            done.append(f"{label} deleted")
        else:
            holder[key] = value
            done.append(f"{label} = {json.dumps(value)}")
    path.write_text(json.dumps(cfg, indent=1))  # NaN and Infinity as Python's json writes them (HF reads them)
    return "; ".join(done)


WRITER_MUTATORS: Dict[str, tuple] = {  # --only name -> (mutation, the model kinds it applies to)
    "writer-weights": (mutate_weights, ("llama", "mlp")),
    "writer-config": (mutate_config, ("llama",)),
}


class _Nonfinite:
    def __init__(self, text):
        self.text = text


def _json_nonfinite(raw: str) -> List[str]:
    """Where a JSON text holds NaN, Infinity or a number beyond float64 (1e999)."""
    def number(s):
        v = float(s)
        return v if np.isfinite(v) else _Nonfinite(s)

    found: List[str] = []

    def walk(o, where):
        if isinstance(o, _Nonfinite):
            found.append(f"{where or '.'} = {o.text}")
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, f"{where}.{k}")
        elif isinstance(o, list):
            for i, v in enumerate(o):
                walk(v, f"{where}[{i}]")
        elif isinstance(o, float) and not np.isfinite(o):
            found.append(f"{where or '.'} = {o}")

    walk(json.loads(raw, parse_constant=_Nonfinite, parse_float=number), "")
    return found


def _array_nonfinite(name: str, a) -> List[str]:
    a = np.asarray(a)
    if a.dtype.kind != "f" and "float" not in a.dtype.name:  # ml_dtypes' float8 / bfloat16 are kind "V"
        return []
    bad = ~np.isfinite(a.astype(np.float32))
    return [f"{name}: {int(bad.sum())} of {a.size} values non-finite"] if bad.any() else []


def scan_nonfinite(path: Path):
    """Every NaN or infinity in a written file ("tensor or key: ..." lines), or None for a file no scan reads.
    Raises when the file cannot be read as what its name says it is."""
    suffix = path.suffix
    if suffix == ".safetensors":
        from safetensors import safe_open

        out = []
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                if t.is_floating_point():
                    bad = ~torch.isfinite(t.float())
                    if bad.any():
                        out.append(f"{k}: {int(bad.sum())} of {t.numel()} values non-finite ({t.dtype})")
        return out
    if suffix == ".gguf":
        import gguf

        reader, out = gguf.GGUFReader(path), []
        floats = (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64)
        for key, field in reader.fields.items():
            if field.types and field.types[-1] in floats:
                values = field.contents()
                values = values if isinstance(values, list) else [values]
                if not all(np.isfinite(values)):
                    out.append(f"{key} = {values[:4]}")
        ints = {getattr(gguf.GGMLQuantizationType, n, None) for n in ("I8", "I16", "I32", "I64")}
        for t in reader.tensors:
            if t.tensor_type not in ints:
                out += _array_nonfinite(f"{t.name} ({t.tensor_type.name})",
                                        gguf.quants.dequantize(t.data, t.tensor_type))
        return out
    if suffix in (".json", ".encodings"):
        return _json_nonfinite(path.read_text())
    if suffix == ".onnx":
        import onnx
        from onnx import numpy_helper

        proto, out = onnx.load(str(path)), []
        for init in proto.graph.initializer:
            out += _array_nonfinite(init.name, numpy_helper.to_array(init))
        for node in proto.graph.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.TENSOR:
                    out += _array_nonfinite(f"{node.name}.{a.name}", numpy_helper.to_array(a.t))
                elif a.type in (onnx.AttributeProto.FLOAT, onnx.AttributeProto.FLOATS):
                    out += _array_nonfinite(f"{node.name}.{a.name}", np.array([a.f] if a.type == 1 else a.floats,
                                                                             dtype=np.float32))
        return out
    if suffix in (".yaml", ".yml"):
        import yaml

        return _json_nonfinite(json.dumps(yaml.safe_load(path.read_text())))
    return None


def _hashes(paths: List[Path]) -> Dict[str, str]:
    import hashlib

    out = {}
    for p in paths:
        for f in sorted([p] if p.is_file() else p.rglob("*")):
            if f.is_file():
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def _writer_worker(conn, mem_gib: float) -> None:
    """Runs qtool's CLI in-process on each argument list it receives; answers (exit code, stderr, escaped)."""
    import logging
    import os
    import resource
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if mem_gib:
        limit = int(mem_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from typer.testing import CliRunner

    from qtool.cli import app

    while True:
        argv = conn.recv()
        if argv is None:
            return
        escaped = None
        try:
            r = CliRunner().invoke(app, argv, catch_exceptions=True)
            code, stderr = r.exit_code, r.stderr
            if r.exception is not None and not isinstance(r.exception, SystemExit):
                tb = traceback.extract_tb(r.exc_info[2])[-1]
                escaped = f"{type(r.exception).__name__}: {str(r.exception)[:160]} ({Path(tb.filename).name}:" \
                          f"{tb.lineno})"
                code = 3
        except BaseException as e:  # noqa: BLE001 - the runner itself failed: count it against this input
            code, stderr, escaped = 3, "", f"{type(e).__name__}: {str(e)[:160]}"
        conn.send((code, stderr, escaped))


class _Worker:
    """One worker process; restarted after a hang or a death."""

    def __init__(self, mem_gib: float):
        self.mem_gib, self.proc = mem_gib, None

    def run(self, argv: List[str], timeout: float):
        """(exit code, stderr, escaped exception) or ("hang" | "crash", detail, None)."""
        import multiprocessing as mp

        if self.proc is None or not self.proc.is_alive():
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_writer_worker, args=(child, self.mem_gib), daemon=True)
            self.proc.start()
        self.conn.send(argv)
        if not self.conn.poll(timeout):
            self.stop(kill=True)
            return "hang", f"over {timeout:g} s", None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            code = self.proc.exitcode
            self.proc = None
            return "crash", f"worker died (exit code {code}; killed by signal {-code})" if code and code < 0 else \
                f"worker died (exit code {code})", None

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            if kill:
                self.proc.kill()
            else:
                try:
                    self.conn.send(None)
                except OSError:
                    pass
            self.proc.join(10)
            self.proc = None


def _error_line(stderr: str, case: Path) -> str:
    import re

    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    line = next((ln for ln in lines if ln.startswith(("error:", "internal error:", "interrupted:"))),
                lines[-1] if lines else "")
    line = re.sub(r" \(traceback in [^;]*; --debug shows it\)", "", line)
    return line.replace(str(case), "<case>")[:300]


def _fresh_exit(argv: List[str], case: Path, timeout: float):
    """The exit code and error line of ``argv`` in a fresh ``python -m qtool`` (output to a new directory)."""
    import subprocess

    argv = [a.replace(str(case / "out"), str(case / "out-fresh")) for a in argv]
    if "imatrix" in argv:
        (case / "out-fresh").mkdir(exist_ok=True)
    try:
        r = subprocess.run([sys.executable, "-m", "qtool", *argv], cwd=REPO, capture_output=True, text=True,
                           timeout=timeout, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                                 "HF_HUB_OFFLINE": "1"})
        return r.returncode, _error_line(r.stderr, case)
    except subprocess.TimeoutExpired:
        return "hang", f"over {timeout:g} s"


def _writer_case(worker: _Worker, path_name: str, case: Path, timeout: float) -> Dict[str, Any]:
    """Run one writer path on the model in ``case/model`` (data ``case/data.safetensors``); what it did and what
    went wrong (``problems``: kind -> detail)."""
    kind, template = WRITER_PATHS[path_name]
    model, data, out = case / "model", case / "data.safetensors", case / "out"
    m = model / "model.safetensors" if kind == "mlp" else model
    argv = [a.format(M=m, OUT=out, IDS=data) for a in template.split()] + ["--quiet"]
    if path_name == "imatrix":
        out.mkdir()
    inputs = [model, data]
    before = _hashes(inputs)
    t0 = time.perf_counter()
    code, stderr, escaped = worker.run(argv, timeout)
    seconds = time.perf_counter() - t0
    problems: Dict[str, str] = {}
    error = escaped or (stderr if code in ("hang", "crash") else _error_line(stderr, case))
    if code == "hang":
        problems["hang"] = error
    elif code == "crash":
        problems["crash"] = error
    elif code == 3:
        problems["exit3"] = error
    elif code not in (0, 2):
        problems["exit_other"] = f"exit {code}: {error}"
    after = _hashes(inputs)
    if after != before:
        changed = sorted(set(before) ^ set(after) | {f for f in before if after.get(f, before[f]) != before[f]})
        problems["input_modified"] = ", ".join(Path(f).relative_to(case).as_posix() for f in changed)
    written = sorted(f for f in out.rglob("*") if f.is_file()) if out.exists() else []
    stray = sorted(p.name for p in case.iterdir() if p.name not in ("model", "data.safetensors", "out"))
    if stray and code not in ("hang", "crash"):  # a killed worker leaves its staging directory: not qtool's doing
        problems["stray_files"] = ", ".join(stray)
    if code != 0 and code not in ("hang", "crash") and (written or (out.exists() and path_name != "imatrix")):
        problems["written_on_error"] = f"exit {code} left {out.name}/ with " + \
            ", ".join(f.relative_to(out).as_posix() for f in written[:6])
    unscanned = []
    if code == 0:
        bad = []
        for f in written:
            try:
                found = scan_nonfinite(f)
            except Exception as e:  # noqa: BLE001 - a file its own format's reader cannot open
                problems.setdefault("unreadable", f"{f.relative_to(out)}: {type(e).__name__}: {str(e)[:120]}")
                continue
            if found is None:
                unscanned.append(f.suffix or f.name)
            bad += [f"{f.relative_to(out)}: {b}" for b in found or []]
        if bad:
            problems["nonfinite"] = "; ".join(bad[:4]) + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else "")
        if not written:
            problems["exit_other"] = "exit 0 but nothing written"
    return {"argv": argv, "exit": code, "error": error if code != 0 else "", "problems": problems,
            "seconds": seconds, "files": len(written), "unscanned": unscanned}


_WRITER_KINDS = ("exit3", "nonfinite", "input_modified", "hang", "written_on_error", "crash", "unreadable",
                 "stray_files", "exit_other")


def _new_case(case: Path, seed_dir: Path) -> Path:
    import shutil

    if case.exists():
        shutil.rmtree(case)
    shutil.copytree(seed_dir, case)
    return case


def writer_baseline(seeds, work: Path, worker: _Worker, timeout: float) -> List[Dict[str, Any]]:
    """Every writer path on every unmutated seed model: what mutated inputs are compared against (a path that
    fails here fails on every input)."""
    import shutil

    out = []
    for path_name, (kind, _) in WRITER_PATHS.items():
        for seed_dir in seeds[kind]:
            case = _new_case(work / "baseline", seed_dir)
            r = _writer_case(worker, path_name, case, max(timeout, 300.0))  # the first case imports everything
            out.append({"path": path_name, "seed": seed_dir.name, "exit": r["exit"], "error": r["error"],
                        "problems": r["problems"], "seconds": round(r["seconds"], 2)})
            shutil.rmtree(case)
    return out


def fuzz_writers(mutator: str, n: int, seed: int, seeds, work: Path, worker: _Worker, timeout: float,
                 keep: Path = None) -> Dict[str, Any]:
    """``n`` mutated models, each through one writer path (cycling over the paths the mutation applies to)."""
    import re
    import shutil

    mutate, kinds = WRITER_MUTATORS[mutator]
    paths = [p for p, (kind, _) in WRITER_PATHS.items() if kind in kinds]
    rng = random.Random(f"{seed}-{mutator}")
    per_path = {p: {"runs": 0, "exit0": 0, "exit2": 0, **{k: 0 for k in _WRITER_KINDS}} for p in paths}
    failures: List[Dict[str, Any]] = []
    distinct: Dict[tuple, Dict[str, Any]] = {}
    unscanned: set = set()
    refusals: Dict[str, int] = {}  # exit 2's error lines (numbers blanked), to see what refuses hostile inputs
    slowest, start = 0.0, time.perf_counter()
    for i in range(n):
        path_name = paths[i % len(paths)]
        seed_dir = rng.choice(seeds[WRITER_PATHS[path_name][0]])
        case = _new_case(work / f"{mutator}-case", seed_dir)
        mutation = f"{seed_dir.name}: {mutate(case / 'model', rng)}"
        r = _writer_case(worker, path_name, case, timeout)
        slowest = max(slowest, r["seconds"])
        unscanned.update(r["unscanned"])
        row = per_path[path_name]
        row["runs"] += 1
        row["exit0"] += r["exit"] == 0
        row["exit2"] += r["exit"] == 2
        if r["exit"] == 2:
            line = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", r["error"])[:200]
            refusals[line] = refusals.get(line, 0) + 1
        for k in r["problems"]:
            row[k] += 1
        if r["problems"]:
            failure = {"input": i, "path": path_name, "mutation": mutation, "exit": r["exit"],
                       "error": r["error"], "problems": r["problems"]}
            failures.append(failure)
            for k, detail in r["problems"].items():
                shape = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", detail if k != "exit3" else r["error"])
                key = (k, path_name, shape[:160])
                if key not in distinct:  # its first input, run again in a fresh process
                    fresh = _fresh_exit(r["argv"], case, max(timeout, 120.0)) if k not in ("hang", "crash") \
                        else None
                    distinct[key] = {"kind": k, "path": path_name, "count": 0, "first_input": i,
                                     "mutation": mutation, "exit": r["exit"], "error": r["error"],
                                     "detail": detail, "fresh": fresh}
                distinct[key]["count"] += 1
            if keep is not None:
                dest = keep / f"{mutator}-{i}"
                if dest.exists():
                    shutil.rmtree(dest)
                shutil.copytree(case, dest, ignore=shutil.ignore_patterns("out", "out-fresh"))
                argv = [a.replace(str(case), ".") for a in r["argv"]]  # run from the saved directory
                (dest / "case.json").write_text(json.dumps({**failure, "argv": argv}, indent=1) + "\n")
        shutil.rmtree(case)
    totals = {k: sum(row[k] for row in per_path.values()) for k in ("runs", "exit0", "exit2", *_WRITER_KINDS)}
    return {"mutator": mutator, "inputs": n, "per_path": per_path, "totals": totals,
            "slowest_s": round(slowest, 2), "seconds": round(time.perf_counter() - start, 1),
            "distinct_failures": list(distinct.values()), "failures": failures[:200],
            "unscanned_suffixes": sorted(unscanned),
            "refusals": dict(sorted(refusals.items(), key=lambda kv: -kv[1])[:40])}


def _print_writer_table(results: List[Dict[str, Any]]) -> None:
    short = {"written_on_error": "on-err", "input_modified": "modif", "nonfinite": "nonfin", "stray_files": "stray",
             "unreadable": "unread", "exit_other": "other"}
    cols = ["runs", "exit0", "exit2", *_WRITER_KINDS]
    print(f"{'mutator':<15}{'writer path':<19}" + "".join(f"{short.get(c, c):>7}" for c in cols))
    for r in results:
        for p, row in [*r["per_path"].items(), ("(all)", r["totals"])]:
            print(f"{r['mutator']:<15}{p:<19}" + "".join(f"{row[c]:>7}" for c in cols))
        print(f"{r['mutator']}: {r['inputs']} inputs in {r['seconds']} s (slowest {r['slowest_s']} s); "
              f"{len(r['distinct_failures'])} distinct failures", flush=True)
        for f in r["distinct_failures"]:
            fresh = "" if f["fresh"] is None else f"  [fresh process: exit {f['fresh'][0]}]"
            print(f"    {f['kind']} x{f['count']} {f['path']} (input {f['first_input']}, {f['mutation']}): exit "
                  f"{f['exit']}: {f['detail'] if f['kind'] != 'exit3' else f['error']}{fresh}")


def run_writers(mutators: List[str], n: int, seed: int, d: Path, timeout: float, mem_gib: float,
                keep: Path = None) -> Dict[str, Any]:
    seeds = _writer_seeds(d / "writer-seeds")
    worker = _Worker(mem_gib)
    try:
        baseline = writer_baseline(seeds, d, worker, timeout)
        bad = [b for b in baseline if b["problems"] or b["exit"] != 0]
        print(f"writer baseline: {len(baseline) - len(bad)} of {len(baseline)} unmutated (path, seed) runs exit 0 "
              "with only finite values written")
        for b in bad:
            print(f"    {b['path']} on {b['seed']}: exit {b['exit']}: {b['error']} {b['problems'] or ''}")
        results = []
        for m in mutators:
            results.append(fuzz_writers(m, n, seed, seeds, d, worker, timeout, keep))
        _print_writer_table(results)
    finally:
        worker.stop()
    return {"per_mutator": n, "timeout_s": timeout, "mem_gib": mem_gib, "baseline": baseline, "results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10_000, help="inputs per reader")
    ap.add_argument("--only", nargs="*", choices=sorted(READERS) + sorted(WRITER_MUTATORS),
                    help="these readers (or writer mutators) only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds after which one input counts as a hang")
    ap.add_argument("--keep", type=Path, help="save failing inputs here")
    ap.add_argument("--writer-n", type=int, help="inputs per writer mutator (default: -n, at most 200)")
    ap.add_argument("--writer-timeout", type=float, default=120.0,
                    help="seconds after which one writer run counts as a hang")
    ap.add_argument("--writer-mem", type=float, default=8.0,
                    help="GiB of address space the writer worker may use (0: no limit)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fuzz_readers.json")
    args = ap.parse_args()
    readers = [r for r in args.only or READERS if r in READERS]
    mutators = [m for m in args.only or WRITER_MUTATORS if m in WRITER_MUTATORS]
    writer_n = args.writer_n if args.writer_n is not None else min(args.n, 200)

    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    signal.signal(signal.SIGALRM, _alarm)
    torch.set_num_threads(1)
    results, writers, refused, writer_fuzz = [], [], [], None
    with tempfile.TemporaryDirectory(prefix="qtool-fuzz-") as tmp:
        if readers:
            world = build_world(Path(tmp))
            writers = check_writers(world)
            refused = [w for w in writers if not w["ok"]]
            print(f"writers: {len(writers) - len(refused)} of {len(writers)} files qtool wrote read back by their "
                  "reader")
            for w in refused:
                print(f"    {w['reader']} seed {w['seed']}: {w['error']}")
            print(f"{'reader':<18}{'inputs':>8}{'accepted':>10}{'refused':>9}{'exit 3':>8}{'hangs':>7}"
                  f"{'slowest s':>11}{'total s':>9}")
        for reader in readers:
            r = fuzz(reader, args.n, args.seed, world, args.timeout, args.keep)
            results.append(r)
            print(f"{reader:<18}{r['inputs']:>8}{r['accepted']:>10}{r['refused']:>9}{r['internal']:>8}{r['hang']:>7}"
                  f"{r['slowest_s']:>11}{r['seconds']:>9}", flush=True)
            for f in r["failures"][:5]:
                print(f"    input {f['input']}: {f['error']}")
        if mutators:
            writer_fuzz = run_writers(mutators, writer_n, args.seed, Path(tmp), args.writer_timeout, args.writer_mem,
                                      args.keep)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seed": args.seed, "per_reader": args.n, "writers": writers,
                                    "results": results, "writer_fuzz": writer_fuzz}, indent=1) + "\n")
    print(f"wrote {args.out}")
    writer_failed = writer_fuzz is not None and any(
        r["distinct_failures"] for r in writer_fuzz["results"])
    if refused or any(r["internal"] or r["hang"] for r in results) or writer_failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
