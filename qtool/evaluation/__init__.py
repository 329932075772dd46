"""``qtool eval``: an exported artifact run by the program that serves its format, against the float model and
against qtool's own fake-quant model on held-out data.

Three models see the same token windows, one after the other (only one is in memory at a time, beside the
reference log-probabilities): the float checkpoint, the fake-quant model its encodings describe, and the artifact
in its runtime (``runtimes`` / ``llamacpp``). For causal LMs: perplexity, per-token KL divergence from float
(mean, 99th percentile, max) and top-1 agreement, as llama-perplexity ``--kl-divergence`` reports them; greedy
continuations and where each first leaves the float model's. The same KL between the fake-quant model and the
artifact is the *export gap*: what the file and its runtime changed of what calibration chose. A gap beyond what
the runtime's own arithmetic explains is an export fault. For other models: output cosine (and top-1 for
classifiers).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..calibration.data_check import refuse_no_kept_token
from ..choices import check_arguments
from ..data import TEXT_SUFFIXES, check_data, data_files, load_data, longest_sample, past_positions, positions_of
from ..errors import DataError, UsageError
from ..hooks import Hooks
from ..io.checkpoint import weight_file_hashes
from ..io.fs import sha256_file
from ..model.apply import make_fake_quant
from ..model.insert import QUANTIZERS_ATTR, quantized_modules, set_stored_weight
from ..model.load import load_model, refuse_non_finite_reference
from ..quant.precision import one_at_a_time
from ..report import ONE_NUMBER_NOTE, _one_number_each, output_cosines, output_errors
from .artifact import Artifact, changed_files, locate, places, quantization_config
from .metrics import Distributions, agreement, divergence, perplexity, token_kl
from .result import Evaluation, check_gate_use, check_gates, describe, enforce
from .runtimes import OnnxRuntime, TorchRuntime, refuse_known_expert_limit, transformers_reload

__all__ = ["EvalOptions", "Evaluation", "evaluate_artifact", "check_held_out", "artifact_model", "locate", "Artifact",
           "check_gates", "enforce", "describe"]

MIN_TOKENS = 16


@dataclass
class EvalOptions:
    data: Optional[str] = None
    seq_len: int = 256
    num_samples: Optional[int] = 8  # windows at most; None: every window the data makes
    seed: int = 0
    batch_size: int = 1
    top_k: int = 1000  # llama.cpp's most likely tokens per position (its KL is over these plus the rest)
    generate: int = 32  # greedy tokens per continuation (0: none)
    prompts: int = 4  # continuations
    prompt_len: int = 32
    threads: int = 0  # llama.cpp / onnxruntime threads; 0: torch's
    onnx_optimization: str = "all"
    device: str = "cpu"
    model_class: Optional[str] = None
    trust_pickle: bool = False
    trust_remote_code: bool = False
    tasks: Tuple[str, ...] = ()  # lm-eval tasks, run on the float model and on the artifact
    tasks_path: Optional[str] = None  # a directory of task YAML of one's own
    task_limit: Optional[int] = None  # documents per task
    task_max_length: int = 1024  # tokens a task request keeps (its last)
    gates: Tuple[str, ...] = ()  # the gates set (max-kl, min-cosine, ...): refused before any model runs if they
    # cannot apply to this model

    def check(self) -> "EvalOptions":
        """Raise ``UsageError`` naming the first option of the wrong type, out of range or not a known choice (the
        CLI's own limits: a library caller's mistake fails before any model loads)."""
        from ..choices import ONNX_OPTIMIZATIONS, check_choice, check_device, check_fields

        check_fields(self, {"seq_len": 2, "num_samples": 1, "batch_size": 1, "top_k": 1, "generate": 0,
                            "prompts": 0, "prompt_len": 1, "threads": 0, "task_limit": 1, "task_max_length": 1})
        check_device(self.device, "EvalOptions.device")
        check_choice("EvalOptions.onnx_optimization", self.onnx_optimization, ONNX_OPTIMIZATIONS)
        return self


def _allowance(runtime, quant: float) -> float:
    """The export gap (the artifact's KL from the fake-quant model, or :meth:`Evaluation.output_gap`) that the runtime's
    own arithmetic explains: its ``gap_share`` of the quantization's own damage plus its ``gap_floor``. torch in float32
    computes what the fake-quant model computes (share 0); llama.cpp quantizes activations to 8 bits inside its
    quantized dot products, and onnxruntime's kernels round quantized activations differently from torch's, which 30
    layers carry on. Measured on SmolLM2-135M (docs/accuracy.md, "Exported files in their runtimes"): healthy gaps 1e-8
    (torch float32), 0.003-0.009 (llama.cpp), 0.032 (onnxruntime W8A8 dynamic, beside the quantization's own 0.030),
    0.027 (MXFP8 W8A8 in transformers, which runs MX in bfloat16: qtool's own fake-quant model cast to bfloat16 moves
    0.0265 from its float32 self, activations rounding to a coarse grid from other inputs; weights only, 0.0013); one
    tensor's block scales doubled in a Q8_0 file: 0.044, in a Q4_0 file 0.165 (beside a quantization KL of 0.344, which
    llama.cpp's former share of 0.5 let pass)."""
    return runtime.gap_share * quant + runtime.gap_floor


# how much of the export gap llama.cpp's own 8-bit activations explain, as a multiple of what they move the fake-quant
# model by in torch (the rest of its arithmetic, float16 KV cache and summation order, rides on them): healthy files
# measured 1.0-1.9 times it where the share rule fell short; an expert zeroed, 3.6-8 times (with the 0.01 floor added
# as well, those passed)
LLAMACPP_OWN_SHARE = 2.5


def _llamacpp_allowance(ev: "Evaluation", allowed: float, why: str, reference: str, enc, opts: "EvalOptions",
                        hooks: Hooks, seqs, fq: "_Scores", stop) -> Tuple[float, str]:
    """The export gap a GGUF file may have once the runtime's 8-bit activations are measured on this model, and its
    reason in words: the fake-quant model run again with each quantized matrix's input rounded as llama.cpp rounds
    it, its KL from the fake-quant model times :data:`LLAMACPP_OWN_SHARE` (no floor beside it), where that exceeds
    ``allowed`` (``why``). Asked only where the gap is past ``allowed``: a router choosing among experts turns those
    roundings into other experts' outputs (an 8-expert Mixtral's correct Q8_0 file read as an export fault), which
    a share of the quantization's own KL does not cover."""
    from .llamacpp import llamacpp_activations

    hooks.on_stage("measuring llama.cpp's 8-bit activations on the fake-quant model")
    model = _fake_quant(reference, enc, "gguf", opts, Evaluation("", "", "", "", None, True, 0, 0))
    with llamacpp_activations(model, QUANTIZERS_ATTR) as rounded:
        if not rounded:
            return allowed, why
        _, (own,) = _score(TorchRuntime(model, "torch"), seqs, [], opts, hooks, "fake-quant, llama.cpp's activations",
                           [fq], stop, keep=False)
    own_allowed = LLAMACPP_OWN_SHARE * own.kl_mean
    if own_allowed <= allowed:
        return allowed, why
    own_why = f"{LLAMACPP_OWN_SHARE:g} x KL {own.kl_mean:.3g}, which its 8-bit activations move the fake-quant model by"
    if ev.export_gap.kl_mean <= own_allowed:
        ev.notes.append(f"the export gap (KL {ev.export_gap.kl_mean:.4g}) is past {why} ({allowed:.3g}), and within "
                        f"what llama.cpp's arithmetic explains on this model ({own_allowed:.3g}: {own_why}): the "
                        "fake-quant model with each quantized matrix's input rounded as llama.cpp rounds it")
    return own_allowed, own_why


def _load(reference: str, opts: EvalOptions):
    return load_model(reference, opts.model_class, opts.device, opts.trust_pickle, opts.trust_remote_code)


def _fake_quant(reference: str, enc: Path, fmt: str, opts: EvalOptions, ev: "Evaluation") -> torch.nn.Module:
    """A fresh fake-quant model of ``enc``, as ``fmt`` stores it (:func:`_as_stored`)."""
    model = _load(reference, opts).model
    _as_stored(model, make_fake_quant(model, reference, enc, opts.trust_pickle), fmt, ev)
    return model


def _threads(opts: EvalOptions) -> int:
    return opts.threads or torch.get_num_threads()


def _open_runtime(art: Artifact, opts: EvalOptions, causal_lm: bool, n_ctx: int, fake_quant=None,
                  activations: bool = True):
    """The artifact's runtime. qtool's own format runs in torch: the fake-quant model (or the float model) with
    the file's dequantized weights in place of the ones calibration computed. ``activations``: the encodings
    quantize activations (onnxruntime's allowance depends on it, and a bfloat16 transformers run's)."""
    if art.format == "gguf":
        if not causal_lm:
            raise UsageError(f"{art.path}: a GGUF file is evaluated against a causal LM checkpoint")
        from .llamacpp import LlamaCpp

        return LlamaCpp(str(art.path), n_ctx=n_ctx, threads=_threads(opts))
    if art.format == "onnx":
        return OnnxRuntime(art.path, opts.onnx_optimization, opts.threads, activations)
    if art.format == "compressed-tensors":
        return transformers_reload(art.path, causal_lm, opts.device, activations, opts.trust_remote_code)
    return TorchRuntime(_with_export_weights(fake_quant, art.path), "qtool (torch)")


def _with_export_weights(model: torch.nn.Module, directory: Path) -> torch.nn.Module:
    from ..export.qtool_st import read_integer_export
    from ..model.checkpoint_map import checkpoint_names

    quantized = quantized_modules(model)
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    tied = _tied(model)
    written = read_integer_export(directory)
    # names the checkpoint (and so the file) gives parameters the model holds under others (Mixtral's
    # block_sparse_moe experts and router, GraniteMoE's router.layer)
    renamed = checkpoint_names(model, [k for k in written if k not in params])
    covered = set()  # the parameters the file holds
    for key, value in written.items():
        key = renamed.get(key, key)
        if key in params:
            covered.add(id(params[key]))
        module, _, attr = key.rpartition(".")
        if attr == "weight" and module in quantized:
            set_stored_weight(quantized[module], value.to(params[key].dtype).to(params[key].device)
                              if key in params else value)
            if key in params and id(params[key]) in tied:  # one table in the file for both: a runtime ties it
                with torch.no_grad():
                    params[key].copy_(value.to(params[key].dtype))
        elif key in params:
            if tuple(params[key].shape) != tuple(value.shape):
                raise UsageError(f"{directory}: tensor {key!r} has shape {list(value.shape)}, the reference model's "
                                 f"has {list(params[key].shape)}: an export of another model?")
            with torch.no_grad():
                params[key].copy_(value.to(params[key].dtype))
        else:
            raise UsageError(f"{directory}: tensor {key!r} is not in the reference model: an export of another model?")
    # a parameter the file lacks would run with the reference's value, and the file read as healthy
    missing = [n for n, p in model.named_parameters() if id(p) not in covered and f".{QUANTIZERS_ATTR}." not in n]
    if missing:
        more = f" and {len(missing) - 1} more parameter(s)" if len(missing) > 1 else ""
        raise UsageError(f"{directory}: the file holds no {missing[0]!r}{more} of the model: not a whole export of "
                         "it")
    return model


def _gguf_metadata(art: Artifact) -> Dict[str, Any]:
    """A GGUF artifact's metadata (``{}`` for other formats), read once for the checks below."""
    if art.format != "gguf":
        return {}
    from ..inspect import inspect_path

    return inspect_path(art.path)["metadata"]


def _same_model(art: Artifact, config, meta: Dict[str, Any]) -> None:
    """Refuse an artifact whose recorded shape (GGUF metadata ``meta``, a compressed-tensors config) is not the
    reference model's: width, depth and vocabulary (and a GGUF file's architecture)."""
    if config is None:
        return
    want = {k: getattr(config, k, None) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    got = {}
    if art.format == "gguf":
        arch = meta.get("general.architecture")
        got = {"hidden_size": meta.get(f"{arch}.embedding_length"), "num_hidden_layers": meta.get(f"{arch}.block_count"),
               "vocab_size": meta.get("tokenizer.ggml.tokens")}
        from ..families import family_of

        family = family_of(getattr(config, "model_type", None))
        if family is not None and family.gguf_arch is not None:  # (a Llama file run against a Qwen2 of its shape)
            want["general.architecture"], got["general.architecture"] = family.gguf_arch, arch
    elif art.format == "compressed-tensors":
        from ..io.checkpoint import check_safetensors, tensor_files
        from ..io.jsonfile import read_json_object

        for f in tensor_files(art.path):  # (a damaged file: transformers' own error, once both models have run)
            check_safetensors(f)
        cfg = read_json_object(art.path / "config.json", UsageError, "Hugging Face config")
        cfg = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
        got = {k: cfg.get(k) for k in want}
    wrong = [f"{k} {got[k]} (the reference's: {want[k]})" for k in want
             if got.get(k) is not None and want[k] is not None and got[k] != want[k]]
    if wrong:
        raise UsageError(f"{art.path}: not an export of the reference model: {', '.join(wrong)}")
    if art.format == "compressed-tensors":
        refuse_known_expert_limit(art.path)  # (before the float model runs: nothing to wait for)


def _check_gguf_biases(path: Path, reference: str) -> None:
    """Refuse a GGUF file that lacks a bias the reference checkpoint holds: llama.cpp runs such a file without it
    (a bias is optional to its graph), within the export gap a damaged scale is allowed, while the torch formats
    refuse a file missing any parameter. (A missing matrix or norm llama.cpp refuses itself.)"""
    from gguf import GGUFReader

    from ..errors import CheckpointError
    from ..export.gguf_model import read_gguf_model
    from ..io.checkpoint import CheckpointTensors

    try:
        model = read_gguf_model(Path(reference))
    except CheckpointError:  # (a reference GGUF export cannot describe: the shape checks above said enough)
        return
    held = {t.name for t in GGUFReader(path).tensors}
    for key in CheckpointTensors(Path(reference)).keys():
        if not key.rsplit(".", 1)[-1].endswith("bias"):  # (DeepSeek's router e_score_correction_bias too)
            continue
        try:
            parts = model.parts(key)
            names = [model.tensor_name(p.key) for p in parts] if parts else [model.tensor_name(key)]
        except CheckpointError:
            continue
        missing = next((n for n in names if n is not None and n not in held), None)
        if missing is not None:
            raise UsageError(f"{path}: the file holds no {missing} (the reference's {key}): not a whole export of "
                             "it; llama.cpp would run it without that bias")


def _check_gguf_finite(path: Path, hooks: Hooks) -> None:
    """Refuse a GGUF file whose tensors decode to NaN or infinity (a damaged or hand-edited scale or norm), before any
    model runs: llama.cpp would score it with made-up figures, or fail on a token deep in the run."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    hooks.on_stage("checking the file's tensors")
    for t in GGUFReader(path).tensors:
        data = np.asarray(t.data)
        rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
        step = max(1, (1 << 24) // max(1, rows[0].nbytes))  # (about 16 MB of the file a slice: bounded memory)
        for start in range(0, rows.shape[0], step):
            part = rows[start:start + step]
            try:
                with np.errstate(all="ignore"):  # (inf * 0 codes warns: the refusal below is the one line)
                    values = part if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) \
                        else dequantize(part, t.tensor_type)
            except (NotImplementedError, ValueError):  # (a type gguf-py cannot decode: llama.cpp's to judge)
                break
            if not np.isfinite(values).all():
                raise UsageError(f"{path}: tensor {t.name} ({t.tensor_type.name}) decodes to NaN or infinity: a "
                                 "damaged file (qtool writes none)")


def _check_context(art: Artifact, n_ctx: int, meta: Dict[str, Any]) -> None:
    """A GGUF file runs in llama.cpp within the context its metadata (``meta``) records: longer windows
    (``--seq-len``, a prompt and its ``--generate`` tokens) are one line before any model runs, not an error from
    llama.cpp once the torch models have."""
    if art.format != "gguf":
        return
    limit = meta.get(f"{meta.get('general.architecture')}.context_length")
    if isinstance(limit, int) and n_ctx - 8 > limit:
        raise UsageError(f"{art.path}: its context is {limit} tokens, and scoring needs {n_ctx - 8} (--seq-len, or a "
                         "prompt and its --generate tokens): give a shorter --seq-len")


def _as_stored(model: torch.nn.Module, enc, fmt: str, ev: "Evaluation") -> None:
    """The fake-quant model as the format stores it: quantizers the format runs in float although the recipe has
    them (compressed-tensors' embedding tables and static integer activations) are switched off, so the export
    gap measures the file, not a documented limit of its layout."""
    from ..export import get_exporter
    from ..export.base import written_float
    from ..model.experts import routing_of
    from ..model.insert import iter_quantizers

    exporter = get_exporter(fmt)
    modules = dict(model.named_modules())
    entries = {e.name: (e, modules[e.module]) for e in enc.entries if e.module in modules}
    off = sorted(written_float(exporter, exporter.Options(), [e for e, _ in entries.values()], model, modules))
    quantizers = dict(iter_quantizers(model))  # named <module>.<tensor>
    if off:
        ev.notes.append(f"the fake-quant model runs {len(off)} quantizer(s) in float as --format {fmt} writes them "
                        f"({', '.join(off[:3])}{', ...' if len(off) > 3 else ''})")
    if fmt == "compressed-tensors":  # what transformers runs of the file, not what the file holds (vLLM runs that)
        written = [e for e, _ in entries.values() if e.name not in off and e.tensor != "weight"]
        # it reloads a MoE's routed experts fused (3-D parameters, no Linear per expert), and compressed-tensors
        # quantizes the inputs of Linear modules only: the experts' inputs run in float
        unapplied = sorted(e.name for e in written if routing_of(modules, e.module) is not None)
        off += unapplied
        if unapplied:
            ev.notes.append(f"the fake-quant model runs the routed experts' {len(unapplied)} activation quantizer(s) "
                            "in float, as transformers runs the file (its experts fused, their inputs not quantized; "
                            "vLLM quantizes them)")
        # compressed-tensors' dynamic "token" strategy takes one range per index of an input's first two dimensions:
        # per token for batch x tokens x hidden, but one for a 2-D input (a shared expert's, its tokens flattened by
        # the MoE block) and one per sequence for a 4-D one (DeepSeek's latent keys, batch x 1 x tokens x rank)
        per_token = [quantizers[f"{e.module}.{e.tensor}"] for e in written
                     if e.dynamic and e.granularity == "per_token" and e.name not in unapplied]
        for q in per_token:
            _tokens_as_compressed_tensors_counts_them(q)
        if per_token:
            ev.notes.append("the fake-quant model's per-token activation quantizers take one range per index of an "
                            "input's first two dimensions, as compressed-tensors does in transformers (one for a "
                            "2-D input such as a shared expert's; vLLM: per token)")
    for name in off:
        e, _ = entries[name]
        quantizers[f"{e.module}.{e.tensor}"].enabled = False
    if fmt == "qtool":  # one table of a weight tied to another module, quantized: a runtime ties the file's to both
        tied = _tied(model)
        for e, m in entries.values():
            q = quantizers.get(f"{e.module}.weight")
            p = getattr(m, "weight", None)
            if e.tensor == "weight" and q is not None and q.enabled and p is not None and id(p) in tied:
                with torch.no_grad():
                    p.copy_(q(p))
                ev.notes.append(f"the fake-quant model computes every layer that shares {e.module}'s weight with "
                                "its quantized table, as a runtime of this file does (the file stores the table "
                                "once, quantized, where qtool.load_calibrated leaves a layer the recipe keeps float "
                                "on the float table)")


def _tied(model: torch.nn.Module) -> set:
    """The parameters (their ids) that more than one module holds (an embedding tied to the output layer)."""
    seen, out = set(), set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (out if id(p) in seen else seen).add(id(p))
    return out


def _tokens_as_compressed_tensors_counts_them(quantizer: torch.nn.Module) -> None:
    """``quantizer`` (one range per position of every dimension but the last) takes one per index of its input's
    first two dimensions instead: the whole of a 2-D input is one, a 4-D input's last two dimensions are one."""
    def before(module, args):
        x = args[0]
        module._qtool_shape = x.shape if x.dim() != 3 else None
        if x.dim() == 2:
            return (x.reshape(1, -1), *args[1:])
        if x.dim() > 3:
            return (x.reshape(x.shape[0], x.shape[1], -1), *args[1:])
        return None

    def after(module, args, out):
        return None if module._qtool_shape is None else out.reshape(module._qtool_shape)

    quantizer.register_forward_pre_hook(before)
    quantizer.register_forward_hook(after)


@one_at_a_time
def artifact_model(artifact: str, reference: Optional[str] = None, encodings: Optional[str] = None,
                   opts: Optional[EvalOptions] = None) -> torch.nn.Module:
    """The artifact as a torch module, for formats that run in torch: qtool's own (the fake-quant model with the
    file's weights) and compressed-tensors (transformers' reload)."""
    opts = opts or EvalOptions()
    art = locate(artifact)
    if art.format not in ("qtool", "compressed-tensors") or (reference or art.checkpoint) is None:
        raise UsageError(f"{artifact}: a torch module is made of qtool and compressed-tensors exports with their "
                         f"reference checkpoint")
    reference = _reference(art, reference, artifact)[0]
    loaded = _load(reference, opts)
    enc = Path(encodings) if encodings else art.encodings
    if art.format == "compressed-tensors":
        return transformers_reload(art.path, loaded.is_causal_lm, opts.device,
                                   trust_remote_code=opts.trust_remote_code).model
    if enc is not None and enc.is_file():
        make_fake_quant(loaded.model, reference, enc, opts.trust_pickle)
    return _with_export_weights(loaded.model, art.path)


def within_positions(checkpoint: str, opts: EvalOptions) -> EvalOptions:
    """``opts`` with windows of at most the positions a Hugging Face checkpoint's config gives (what a GGUF file's
    context is, so llama.cpp runs them): for ``quantize --eval``, which takes eval's defaults and has no --seq-len
    of its own for them."""
    from dataclasses import replace

    from ..io.checkpoint import detect_kind
    from ..io.jsonfile import read_json_object

    path = Path(checkpoint)
    if detect_kind(path) != "hf" or not (path / "config.json").is_file():
        return opts
    config = read_json_object(path / "config.json", UsageError, "Hugging Face config")
    positions = positions_of(config.get("text_config") if isinstance(config.get("text_config"), dict) else config)
    if positions is None or positions <= 0:
        return opts
    return replace(opts, seq_len=min(opts.seq_len, positions), prompt_len=min(opts.prompt_len, positions // 2),
                   generate=min(opts.generate, positions - min(opts.prompt_len, positions // 2)))


def check_held_out(checkpoint: str, opts: EvalOptions) -> None:
    """The checks of the held-out data that need no weights (text too short for a window, ids of another shape),
    for a caller about to spend a calibration before evaluating (``quantize --eval``): a Hugging Face directory's
    tokenizer and model class alone. (Other checkpoints' data is checked when their model runs.)"""
    from ..io.checkpoint import detect_kind
    from ..model.hf import meta_skeleton, tokenizer_of
    from ..model.load import causal_lm_class

    path = Path(checkpoint)
    if detect_kind(path) == "hf":
        _windows(opts, tokenizer_of(path, opts.trust_remote_code),
                 causal_lm_class(meta_skeleton(path, opts.trust_remote_code)))


def _windows(opts: EvalOptions, tokenizer, causal_lm: bool, vocab: Optional[int] = None):
    """The held-out windows: token id lists for a causal LM (checked against its ``vocab`` embeddings, as
    calibration checks them, before any model runs), else the batches."""
    if opts.data is None:
        raise DataError("qtool eval runs the models on held-out data: pass --data PATH (text or tensors)")
    data = load_data(opts.data, 1 if causal_lm else opts.batch_size, opts.num_samples, opts.seed, opts.seq_len,
                     tokenizer, pack_text=causal_lm, at_most=True)
    refuse_no_kept_token(data, "an evaluation")
    if not causal_lm:
        return list(data)
    seqs = []
    for b in data:
        if "input_ids" not in b.kwargs and not b.args:  # (several tensors, none named input_ids)
            raise DataError(f"{opts.data}: the data's tensors are named {', '.join(sorted(b.kwargs))}, and none is "
                            "input_ids: name the token ids input_ids")
        ids = b.kwargs["input_ids"] if "input_ids" in b.kwargs else b.args[0]
        # (a bool file read as ids 0 and 1, which calibration refuses)
        if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise DataError(f"{opts.data}: token ids must be integers of shape [sequences, tokens] (got "
                            f"{str(ids.dtype).replace('torch.', '')} samples of shape {list(ids.shape[1:])})")
        mask = b.kwargs.get("attention_mask")
        rows = [ids[r] if mask is None else ids[r][mask[r] > 0] for r in range(ids.shape[0])]  # (padding: dropped)
        rows = [row for row in rows if row.numel()]  # (a row its mask keeps nothing of: no window; it ran empty)
        kept = torch.cat(rows) if rows else ids.reshape(-1)
        if kept.numel() and int(kept.min()) < 0:
            raise DataError(f"{opts.data}: token id {int(kept.min())} is negative (a padding marker such as -100? an "
                            "attention_mask of 0 there leaves it out)")
        if kept.numel() and vocab and int(kept.max()) >= vocab:
            raise DataError(f"{opts.data}: token id {int(kept.max())} is outside the model's vocabulary ({vocab} "
                            "embeddings): the tokenizer (or the id file) belongs to another model")
        seqs += [row.tolist() for row in rows]
    scored = sum(max(0, len(s) - 1) for s in seqs)  # (a window's first token has nothing before it to predict)
    if scored < MIN_TOKENS:
        text = any(f.suffix.lower() in TEXT_SUFFIXES for f in data_files(opts.data))
        windows = (f"{len(seqs)} window(s) of up to --seq-len {opts.seq_len}" if text else
                   f"{len(seqs)} token-id row(s), scored as given (--seq-len cuts text only),")
        more = "more text, or a longer --seq-len or more --num-samples" if text else (
            "more or longer rows of token ids, or text"
            + (f", or more --num-samples ({opts.num_samples} rows were read)" if len(seqs) >= opts.num_samples
               else ""))
        raise DataError(f"{opts.data}: too few tokens to score: {windows} predict {scored} next tokens, and at least "
                        f"{MIN_TOKENS} are needed (a few thousand give stable figures): give {more}")
    return seqs


def _stop_tokens(tokenizer, model) -> List[int]:
    """Where a continuation ends: the tokenizer's end-of-text token and the model's generation config's."""
    ids = [getattr(tokenizer, "eos_token_id", None)]
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += eos if isinstance(eos, list) else [eos]
    return sorted({int(i) for i in ids if i is not None})


def _prompts(seqs: List[List[int]], opts: EvalOptions) -> List[List[int]]:
    if opts.generate <= 0 or opts.prompts <= 0:
        return []
    n = max(1, min(opts.prompt_len, min(len(s) for s in seqs) // 2))
    return [s[:n] for s in seqs[:opts.prompts]]


class _Scores:
    """Reference log-probabilities of every window (float32 on the CPU: tokens × vocabulary × 4 bytes)."""

    def __init__(self):
        self.logp: List[torch.Tensor] = []
        self.targets: List[torch.Tensor] = []
        self.argmax: List[torch.Tensor] = []
        self.generations: List[List[int]] = []


def _score(runtime, seqs, prompts, opts: EvalOptions, hooks: Hooks, label: str, refs: List[_Scores],
           stop: List[int], keep: bool = True):
    """Run ``runtime`` over every window: its own scores, and each reference's KL / top-1 against it. ``keep``:
    hold its whole log-probabilities (it is the reference of a later model)."""
    from ..hooks import step

    mine = _Scores()
    kls: List[List[torch.Tensor]] = [[] for _ in refs]
    same: List[List[torch.Tensor]] = [[] for _ in refs]
    # progress in the runtime's own steps, so that its time-left estimate holds: a forward pass (a window), or for
    # llama.cpp one position (a request each); the continuations are a step of their own, counted in tokens (one
    # token generated costs a fraction of a window's pass: counted alike, the time left read 3-6x too long)
    per_position = getattr(runtime, "steps_per_position", False)
    window = [len(ids) if per_position else 1 for ids in seqs]
    total, done = sum(window), 0
    for i, ids in enumerate(seqs):
        d: Distributions = runtime.distributions(ids, opts.top_k)
        if keep:
            mine.logp.append(d.full.float())
        mine.targets.append(d.target)
        mine.argmax.append(d.argmax)
        for j, ref in enumerate(refs):
            vocab = ref.logp[i].shape[-1]
            if (d.full is not None and d.full.shape[-1] != vocab) or int(d.top_ids.max()) >= vocab:
                raise UsageError(f"{label} predicts over another vocabulary than the reference model's {vocab} "
                                 f"tokens: an export of another model?")
            kls[j].append(token_kl(ref.logp[i], d))
            same[j].append(ref.argmax[i] == d.argmax)
        done += window[i]
        step(f"scoring ({label})", done, total, f"window {i + 1}/{len(seqs)}")
    for i, p in enumerate(prompts):
        mine.generations.append(runtime.greedy(p, opts.generate, stop))
        step(f"continuing ({label})", (i + 1) * opts.generate, len(prompts) * opts.generate,
             f"continuation {i + 1}/{len(prompts)}")
    return mine, [agreement(k, s) for k, s in zip(kls, same)]


@one_at_a_time
def evaluate_artifact(artifact: str, reference: Optional[str], encodings: Optional[str], opts: EvalOptions,
                      hooks: Optional[Hooks] = None) -> Evaluation:
    """Evaluate ``artifact`` (see :func:`locate`) against the float ``reference`` checkpoint (default: the one its
    manifest names) and the fake-quant model of ``encodings`` (default: the manifest's), on ``opts.data``."""
    from ..hooks import reporting

    check_arguments(artifact, opts, EvalOptions, "artifact", paths={
        k: v for k, v in (("reference", reference), ("encodings", encodings)) if v is not None}, hooks=(hooks, Hooks))
    artifact, reference, encodings = (None if v is None else os.fspath(v) for v in (artifact, reference, encodings))
    hooks = hooks or Hooks()
    opts.check()
    art = locate(artifact)
    check_data(opts.data)  # (text that cannot be read is named before either model loads)
    reference, other_weights = _reference(art, reference, artifact)
    notes = [other_weights] if other_weights else []
    enc = Path(encodings) if encodings else art.encodings
    if encodings and not enc.is_file():
        raise UsageError(f"{enc}: no such encodings file")
    other_encodings, unchecked = _calibrated_elsewhere(enc, reference) if encodings else (None, None)
    if unchecked:
        notes.append(unchecked)
    # (what an export fault's line then adds: the fault may be the encodings', not the file's)
    other_why = f"the encodings given ({enc}) were calibrated on other weights than {reference}"
    if encodings and not other_encodings and art.encodings_sha256 and sha256_file(enc) != art.encodings_sha256:
        other_why = f"the encodings given ({enc}) are not the ones the file was exported from"
        other_encodings = (f"{other_why} (its manifest records sha256 {art.encodings_sha256[:12]}): the fake-quant "
                           "model is another calibration's")
    if other_encodings:
        notes.append(other_encodings)
    changed = changed_files(art)
    if changed:
        notes.append(f"{', '.join(changed)} in {art.directory}: not the bytes the export's manifest records (a "
                     "file replaced or edited since qtool wrote it): the figures are this file's, not the export's")
    if not encodings and art.encodings_missing is not None:
        notes.append(f"the encodings the manifest names ({art.encodings_missing}) are not here or beside "
                     f"{art.directory} with the sha256 it records")
    manager = None
    if opts.tasks:
        from .tasks import task_manager

        manager = task_manager(opts.tasks_path, opts.tasks)
    with reporting(hooks):
        ev = _evaluate(art, reference, enc, opts, hooks, manager, notes)
    if ev.export_fault and other_weights:
        ev.export_fault += (f"; but {reference} holds other weights than the checkpoint the artifact's manifest "
                            f"records ({art.checkpoint}), so the fake-quant model is of other weights: evaluate "
                            "against that checkpoint before blaming the file")
    elif ev.export_fault and other_encodings:
        ev.export_fault += (f"; but {other_why}, so the fake-quant model is not what the file was made from: pass "
                            "the encodings it was exported from before blaming the file")
    return ev


def _calibrated_elsewhere(enc: Path, reference: str) -> Tuple[Optional[str], Optional[str]]:
    """``(a note where the calibration manifest beside ``enc`` records other weights than ``reference``'s, a note
    where no readable manifest lies there to compare with)``: notes at most, as a --reference of other weights."""
    from ..encodings import calibrated_elsewhere

    other, unchecked = calibrated_elsewhere(enc, weight_file_hashes(Path(reference)), reference, unreadable_ok=True)
    if other is None:
        return None, unchecked
    return (f"the encodings given ({enc}) were calibrated on other weights ({other}) than the float checkpoint "
            f"{reference}: the fake-quant model applies them to {reference}'s"), None


def _text_tokens(batches) -> Optional[int]:
    """The tokens a model of text read (those its attention masks keep, else every input id); None for other
    inputs (images, features), which have none."""
    if all("attention_mask" in b.kwargs for b in batches):
        return sum(int(b.kwargs["attention_mask"].sum()) for b in batches)
    if all("input_ids" in b.kwargs for b in batches):
        return sum(int(b.kwargs["input_ids"].numel()) for b in batches)
    return None


def _reference(art: Artifact, given: Optional[str], artifact: str) -> Tuple[str, Optional[str]]:
    """The float checkpoint to compare with, and a note where it is a ``given`` one with other weights than the
    manifest records: ``given``, else the one the manifest names, found (its path is as given where the job ran: see
    ``places``) where its weight files have the sha256 the manifest records, so that another model at that path is
    never taken for it."""
    if given is not None:
        if not Path(given).exists():
            raise UsageError(f"{given}: the float checkpoint is not there (pass --reference PATH)")
        if art.checkpoint_sha256 and weight_file_hashes(Path(given)) != art.checkpoint_sha256:
            return given, (f"{given} holds other weights than the checkpoint the artifact's manifest records "
                           f"({art.checkpoint}): the float and fake-quant models are {given}'s")
        return given, None
    if art.checkpoint is None:
        raise UsageError(f"{artifact}: no manifest names the float checkpoint it came from: pass --reference PATH")
    there = [c for c in places(art.checkpoint, art.directory or Path(".")) if c.exists()]
    if not there:
        raise UsageError(f"{art.checkpoint}: the float checkpoint is not there, nor beside {art.directory} (pass "
                         "--reference PATH)")
    if not art.checkpoint_sha256:
        return str(there[0]), None
    for c in there:
        if weight_file_hashes(c) == art.checkpoint_sha256:
            return str(c), None
    raise UsageError(f"{there[0]}: not the float checkpoint {artifact} was made from (its weight files' sha256 are "
                     "not those its manifest records): pass --reference PATH")


def _run_tasks(runtime, tokenizer, opts: EvalOptions, manager, label: str, hooks: Hooks):
    from .tasks import run_tasks

    hooks.on_stage(f"running tasks on the {label} ({', '.join(opts.tasks)})")
    return run_tasks(runtime, tokenizer, opts.tasks, manager, opts.task_limit, opts.task_max_length, label)


def _evaluate(art: Artifact, reference: str, enc: Optional[Path], opts: EvalOptions, hooks: Hooks,
              manager=None, notes: Tuple[str, ...] = ()) -> Evaluation:
    hooks.on_stage("loading the float checkpoint")
    loaded = _load(reference, opts)
    refuse_non_finite_reference(loaded.model, reference)
    causal = loaded.is_causal_lm
    if art.format == "gguf" and not causal:
        raise UsageError(f"{art.path}: a GGUF file is evaluated against a causal LM checkpoint; {reference} is not one")
    meta = _gguf_metadata(art)
    _same_model(art, loaded.config, meta)
    check_gate_use(opts.gates, causal, enc is not None)
    activations = True
    if enc is not None:  # another model's encodings: one line now, not after the float model has run
        from ..encodings import EncodingsFile
        from ..model.apply import plan_from_encodings

        enc_file = EncodingsFile.read(enc)
        plan_from_encodings(enc_file, loaded.model, str(enc))
        activations = any(e.tensor != "weight" for e in enc_file.entries)
    try:
        vocab = getattr(loaded.model.get_input_embeddings(), "num_embeddings", None)
    except (AttributeError, NotImplementedError):
        vocab = None
    data = _windows(opts, loaded.tokenizer, causal, vocab)
    ev = Evaluation(str(art.path), art.format, "", str(reference), str(enc) if enc else None, causal,
                    len(data), 0)
    ev.notes.extend(notes)
    past = past_positions(getattr(loaded.model, "config", None),
                          max((len(s) for s in data), default=0) if causal else longest_sample(data),
                          data_files(opts.data))
    if past is not None:
        ev.notes.append(past)
    if enc is None:
        ev.notes.append("no encodings: the artifact is compared with the float model only (pass --encodings "
                        "for the export gap)")
    if not causal:
        if opts.tasks:
            raise UsageError("--tasks runs lm-eval's tasks on causal LMs")
        return _evaluate_outputs(ev, art, loaded, reference, enc, data, opts, hooks, activations)
    tokenizer = loaded.tokenizer
    stop = _stop_tokens(tokenizer, loaded.model)
    task_results: Dict[str, Any] = {}
    seqs = data
    prompts = _prompts(seqs, opts)
    ev.tokens = sum(len(s) - 1 for s in seqs)
    n_ctx = max(max(len(s) for s in seqs), max((len(p) for p in prompts), default=0) + opts.generate) + 8
    _check_context(art, n_ctx, meta)
    if art.format == "gguf":  # (after the cheap checks: decoding a large file takes a while)
        _check_gguf_biases(art.path, reference)
        _check_gguf_finite(art.path, hooks)
    if opts.tasks:
        n_ctx = max(n_ctx, opts.task_max_length + 8)

    hooks.on_stage("measuring the float model")
    flt, _ = _score(TorchRuntime(loaded.model, "torch"), seqs, prompts, opts, hooks, "float", [], stop)
    ev.perplexity["float"] = perplexity(flt.targets)
    if opts.tasks:
        task_results["float"] = _run_tasks(TorchRuntime(loaded.model, "torch"), tokenizer, opts, manager,
                                           "float model", hooks)
    model = loaded.model
    del loaded
    fq = None
    if enc is not None:
        hooks.on_stage("measuring the fake-quant model")
        model = None  # one model in memory at a time
        model = _fake_quant(reference, enc, art.format, opts, ev)
        fq, (fq_vs_float,) = _score(TorchRuntime(model, "torch"), seqs, prompts, opts, hooks, "fake-quant", [flt],
                                    stop)
        ev.perplexity["fake_quant"] = perplexity(fq.targets)
        ev.vs_float["fake_quant"] = fq_vs_float
        if prompts:
            ev.generations["fake_quant"] = divergence(flt.generations, fq.generations, opts.generate)
    if art.format != "qtool":
        model = None  # qtool's format runs in the model just measured, with the file's weights
    hooks.on_stage(f"opening the artifact ({art.runtime})")
    runtime = _open_runtime(art, opts, True, n_ctx, model, activations)
    ev.runtime = runtime.name
    try:
        hooks.on_stage(f"measuring the artifact in {runtime.name}")
        refs = [flt] + ([fq] if fq is not None else [])
        got, vs = _score(runtime, seqs, prompts, opts, hooks, runtime.name, refs, stop, keep=False)
        if opts.tasks:
            task_results["artifact"] = _run_tasks(runtime, tokenizer, opts, manager, "artifact", hooks)
    finally:
        runtime.close()
    ev.perplexity["artifact"] = perplexity(got.targets)
    if opts.tasks:
        from .tasks import side_by_side

        ev.tasks = side_by_side(task_results)
    ev.vs_float["artifact"] = vs[0]
    if prompts:
        ev.generations["artifact"] = divergence(flt.generations, got.generations, opts.generate)
    if fq is not None:
        ev.export_gap = vs[1]
        quant = ev.vs_float["fake_quant"].kl_mean
        allowed = _allowance(runtime, quant)
        why = f"{runtime.gap_share:g} x the quantization's KL {quant:.3g} + {runtime.gap_floor:g}"
        if ev.export_gap.kl_mean > allowed and art.format == "gguf":  # (under --max-export-gap too: the JSON's
            # export_fault stays the rule's verdict, which the gate then overrides)
            allowed, why = _llamacpp_allowance(ev, allowed, why, reference, enc, opts, hooks, seqs, fq, stop)
        if ev.export_gap.kl_mean > allowed:
            ev.export_fault = (f"the artifact differs from qtool's fake-quant model by KL {ev.export_gap.kl_mean:.4g} "
                               f"(top-1 agreement {ev.export_gap.top1:.3f}), beyond what {runtime.name}'s own "
                               f"arithmetic explains ({allowed:.3g}: {why})")
            if isinstance(runtime, OnnxRuntime) and opts.onnx_optimization != "off":
                _graph_as_written(ev, art, activations, opts, hooks, seqs, fq, stop, allowed)
            elif (art.format == "compressed-tensors" and enc is not None
                  and (quantization_config(art.path) or {}).get("transform_config")):
                _with_online_rotations(ev, art, enc, activations, opts, hooks, seqs, fq, stop, allowed)
    vocab = flt.logp[0].shape[-1] if flt.logp else None
    if art.format == "gguf" and (vocab is None or opts.top_k < vocab):  # (a smaller vocabulary: the full KL)
        ev.notes.append(f"llama.cpp reports its {opts.top_k} most likely tokens per position: its KL is over those "
                        f"plus one bucket for the rest of the vocabulary (a lower bound of the full KL)")
    return ev


def _graph_as_written(ev: Evaluation, art: Artifact, activations: bool, opts: EvalOptions, hooks: Hooks, seqs, fq,
                      stop, allowed: float) -> None:
    """An ONNX gap past the allowance under onnxruntime's optimized kernels: run the graph as written
    (optimizations off). Within the allowance there, the file holds what calibration chose and the gap is the
    optimized kernels' arithmetic (docs/formats.md: fused integer kernels that saturate on CPUs without VNNI):
    said in a note, not an export fault."""
    hooks.on_stage("running the ONNX graph as written (optimizations off) to tell the file from the kernels")
    plain = OnnxRuntime(art.path, "off", opts.threads, activations)
    try:
        _, (graph,) = _score(plain, seqs, [], opts, hooks, plain.name, [fq], stop, keep=False)
    finally:
        plain.close()
    if graph.kl_mean <= allowed:
        ev.notes.append(f"{ev.runtime}'s optimized kernels move the outputs by KL {ev.export_gap.kl_mean:.4g} from "
                        f"the fake-quant model; the graph run as written (--onnx-optimization off) stays within "
                        f"{allowed:.3g} (KL {graph.kl_mean:.4g}): the runtime's arithmetic, not the file")
        ev.export_fault = None
    else:
        ev.export_fault += f"; the graph run as written (optimizations off) too: KL {graph.kl_mean:.4g}"


def _with_online_rotations(ev: Evaluation, art: Artifact, enc: Path, activations: bool, opts: EvalOptions,
                           hooks: Hooks, seqs, fq, stop, allowed: float) -> None:
    """A compressed-tensors gap past the allowance where the file carries a ``transform_config``: transformers
    loads the weights but does not apply the transforms (as of transformers 5.23; vLLM does), so it runs the
    rotated weights on unrotated activations. Run the same reload with the rotations the encodings record installed
    on it (``model.online``): within the allowance there, the file holds what calibration chose and the gap is the
    runtime's missing transform support, said in a note, not an export fault."""
    from ..encodings import EncodingsFile
    from ..model.online import install_online

    online = EncodingsFile.read(enc, lazy=True).online
    if not online:
        return
    hooks.on_stage("running the directory with its online rotations applied, to tell the file from the runtime")
    rotated = transformers_reload(art.path, True, opts.device, activations, opts.trust_remote_code)
    try:
        modules = _experts_as_linears(rotated.model, art.path)
        missing = sorted({m for r in online for m in r.modules} - set(modules))
        if missing:
            ev.notes.append(f"could not apply the file's online rotations to transformers' reload: it has no module "
                            f"{missing[0]} (of {len(missing)}), so the export gap is not told apart from the "
                            "runtime's missing transform support")
            return
        install_online(modules, online)
        _, (gap,) = _score(rotated, seqs, [], opts, hooks, rotated.name, [fq], stop, keep=False)
    finally:
        rotated.close()
    names = ", ".join(sorted({r.name for r in online}))
    if gap.kl_mean <= allowed:
        ev.notes.append(f"{ev.runtime} does not apply the file's transform_config (online rotations {names}): it "
                        f"runs the rotated weights on unrotated activations (KL {ev.export_gap.kl_mean:.4g} from the "
                        f"fake-quant model). With the rotations applied the same reload stays within {allowed:.3g} "
                        f"(KL {gap.kl_mean:.4g}): the runtime's limit, not the file; serve it where transform_config "
                        f"runs (vLLM)")
        ev.export_fault = None
    else:
        ev.export_fault += f"; with its online rotations ({names}) applied too: KL {gap.kl_mean:.4g}"


def _experts_as_linears(model, directory: Path) -> Dict[str, Any]:
    """``model``'s modules, with fused mixture-of-experts modules replaced by one Linear per expert as qtool's own
    loader makes them (``model.experts``), so that a rotation of an expert's input, named as qtool names it, has a
    module to sit on. The experts are found from the directory's tensor names (compressed-tensors' packed ones read
    as the weight they hold)."""
    from ..io.checkpoint import safetensors_index, tensor_files
    from ..model.experts import linearize_experts

    keys = {re.sub(r"\.weight_packed$", ".weight", k) for k in safetensors_index(tensor_files(Path(directory)))}
    linearize_experts(model, keys)
    return dict(model.named_modules())


def _relative_error(errors: torch.Tensor, norms: torch.Tensor) -> Dict[str, float]:
    """Mean and max of the samples' ``|out - ref| / |ref|`` (samples whose reference output is all zeros have none),
    and ``pooled``, ``sqrt(Σ|out - ref|² / Σ|ref|²)`` over every sample (one sample near zero cannot dominate it)."""
    kept = norms > 0
    rel = (errors[kept] / norms[kept]).sqrt()
    total = float(norms.sum())
    return {"mean": float(rel.mean()) if rel.numel() else float("nan"),
            "max": float(rel.max()) if rel.numel() else float("nan"),
            "pooled": (float(errors.sum()) / total) ** 0.5 if total > 0 else float("nan")}


def _float_outputs(model, batches, source: str) -> List[torch.Tensor]:
    """The float model's main output of each batch; data the model cannot take (a BERT's 128 positions under a
    window of 256) is one line naming the batch, before any artifact runs."""
    from ..data import batch_where, model_takes

    runtime = TorchRuntime(model, "torch")
    out = []
    for i, b in enumerate(batches):
        with model_takes(model, b, batch_where(source, "evaluation", i + 1)):  # (1-based, as calibration's)
            out.append(runtime.outputs(b))
    return out


def _evaluate_outputs(ev: Evaluation, art: Artifact, loaded, reference: str, enc: Optional[Path], batches,
                      opts: EvalOptions, hooks: Hooks, activations: bool) -> Evaluation:
    """Models that are not causal LMs: the main output's cosine (and top-1 of a ``[N, classes]`` output)."""
    hooks.on_stage("measuring the float model")
    flt = _float_outputs(loaded.model, batches, str(opts.data))
    model = None
    fq = None
    if enc is not None:
        hooks.on_stage("measuring the fake-quant model")
        model = _fake_quant(reference, enc, art.format, opts, ev)
        fq = [TorchRuntime(model, "torch").outputs(b) for b in batches]
    elif art.format == "qtool":
        model = loaded.model
    runtime = _open_runtime(art, opts, False, 0, model, activations)
    ev.runtime = runtime.name
    hooks.on_stage(f"measuring the artifact in {runtime.name}")
    try:
        got = [runtime.outputs(b) for b in batches]
    finally:
        runtime.close()
    pairs = {"fake_quant": (flt, fq), "artifact": (flt, got), "export_gap": (fq, got)}
    for name, (a, b) in pairs.items():
        if a is None or b is None:
            continue
        if any(x.shape != y.shape for x, y in zip(a, b)):
            raise UsageError(f"{art.path}: its outputs have another shape than the reference model's: an export of "
                             f"another model?")
        c = output_cosines(a, b, batches).double()
        ev.cosine[name] = {"mean": float(c.mean()), "min": float(c.min())}
        ev.relative_error[name] = _relative_error(*output_errors(a, b, batches))
        if all(x.dim() == 2 and x.shape[-1] > 1 for x in a):
            same = torch.cat([x.argmax(-1) == y.argmax(-1) for x, y in zip(a, b)])
            ev.top1[name] = float(same.double().mean())
    ev.tokens = _text_tokens(batches)
    if all(_one_number_each(x) for x in flt):
        ev.notes.append(ONE_NUMBER_NOTE)
    if fq is not None:
        quant = ev.output_gap("fake_quant")
        gap = ev.output_gap("export_gap")
        allowed = _allowance(runtime, quant)
        if gap > allowed:
            ev.export_fault = (f"the artifact's outputs differ from qtool's fake-quant model's (cosine "
                               f"{ev.cosine['export_gap']['mean']:.5f}, pooled relative error "
                               f"{ev.relative_error['export_gap']['pooled']:.3g}) beyond what {runtime.name}'s own "
                               f"arithmetic explains (gap {gap:.3g} > {allowed:.3g})")
    return ev
