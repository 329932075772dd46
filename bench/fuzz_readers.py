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
    write_imatrix(d / "imatrix.gguf", {f"blk.{i}.attn_q.weight": (torch.rand(64, generator=g) * 100, 50)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10_000, help="inputs per reader")
    ap.add_argument("--only", nargs="*", choices=sorted(READERS), help="these readers only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds after which one input counts as a hang")
    ap.add_argument("--keep", type=Path, help="save failing inputs here")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fuzz_readers.json")
    args = ap.parse_args()

    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    signal.signal(signal.SIGALRM, _alarm)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="qtool-fuzz-") as tmp:
        world = build_world(Path(tmp))
        writers = check_writers(world)
        refused = [w for w in writers if not w["ok"]]
        print(f"writers: {len(writers) - len(refused)} of {len(writers)} files qtool wrote read back by their reader")
        for w in refused:
            print(f"    {w['reader']} seed {w['seed']}: {w['error']}")
        print(f"{'reader':<18}{'inputs':>8}{'accepted':>10}{'refused':>9}{'exit 3':>8}{'hangs':>7}{'slowest s':>11}"
              f"{'total s':>9}")
        for reader in args.only or list(READERS):
            r = fuzz(reader, args.n, args.seed, world, args.timeout, args.keep)
            results.append(r)
            print(f"{reader:<18}{r['inputs']:>8}{r['accepted']:>10}{r['refused']:>9}{r['internal']:>8}{r['hang']:>7}"
                  f"{r['slowest_s']:>11}{r['seconds']:>9}", flush=True)
            for f in r["failures"][:5]:
                print(f"    input {f['input']}: {f['error']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"seed": args.seed, "per_reader": args.n, "writers": writers,
                                    "results": results}, indent=1) + "\n")
    print(f"wrote {args.out}")
    if refused or any(r["internal"] or r["hang"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
