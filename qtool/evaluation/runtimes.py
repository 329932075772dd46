"""The programs that run an artifact, behind one small interface: ``distributions(ids, k)`` (next-token
predictions along one sequence), ``greedy(prompt, n)`` (a greedy continuation) and, for models that are not
causal LMs, ``outputs(batch)``. torch models (the float reference, qtool's fake-quant model, qtool's own format,
transformers' reload of a compressed-tensors directory) and onnxruntime hand over whole logits; llama.cpp
(``evaluation.llamacpp``) its top tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

from ..data import Batch
from ..errors import UsageError, cut
from ..report import _main_output
from .artifact import quantization_config
from .metrics import Distributions


class _WholeLogits:
    """A runtime that hands over its whole logits (``logits(ids)``: ``[T, V]``)."""

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        raise NotImplementedError

    def distributions(self, ids: Sequence[int], k: int, start: int = 1) -> Distributions:
        return Distributions.from_logits(self.logits(ids), ids, 1, start)  # whole logits: the top 1 is enough

    def greedy(self, prompt: Sequence[int], n: int, stop: Sequence[int] = ()) -> List[int]:
        """Greedy decoding over the whole sequence at each step (no cache layout in between), ending after the
        first token in ``stop``."""
        ids, made = [int(t) for t in prompt], []
        for _ in range(n):
            made.append(int(self.logits(ids + made)[-1].argmax()))
            if made[-1] in stop:
                break
        return made


class TorchRuntime(_WholeLogits):
    """A torch module: its logits are the runtime's."""

    def __init__(self, model: nn.Module, name: str, gap_share: float = 0.0, gap_floor: float = 1e-4):
        try:
            model.eval()
        except NotImplementedError:  # (a torch.export module fixed its train/eval behaviour when it was exported)
            pass
        self.model = model
        self.name = name
        # float32 torch computes what the fake-quant model computes (see evaluation's export gap)
        self.gap_share, self.gap_floor = gap_share, gap_floor
        self.device = next(iter(model.parameters())).device

    @torch.no_grad()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        return _main_output(self.model(input_ids=x, use_cache=False))[0].float().cpu()

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], n: int, stop: Sequence[int] = ()) -> List[int]:
        """Up to ``n`` greedy tokens, ending after the first token in ``stop``: as transformers serves it
        (``generate`` with its KV cache); step by step over the whole sequence for modules without it."""
        ids = [int(t) for t in prompt]
        if n <= 0:
            return []
        if not hasattr(self.model, "generate"):
            return super().greedy(ids, n, stop)
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        stop = [int(t) for t in stop]
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, num_beams=1,
                                  max_new_tokens=n, eos_token_id=stop or None,
                                  pad_token_id=stop[0] if stop else None)
        made = [int(t) for t in out[0, len(ids):]]
        for i, t in enumerate(made):  # (a batch of one is not padded, but be sure)
            if t in stop:
                return made[:i + 1]
        return made

    @torch.no_grad()
    def outputs(self, batch: Batch) -> torch.Tensor:
        b = batch.to(self.device)
        return _main_output(self.model(*b.args, **b.kwargs)).float().cpu()

    def close(self) -> None:
        self.model = None


_ORT_FLOATS = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16, "tensor(double)": torch.float64}


class OnnxRuntime(_WholeLogits):
    """An ONNX graph in onnxruntime on the CPU, with the graph optimizations users run it with (``all``, its
    default) unless told otherwise. ``activations``: the graph quantizes activations. Its kernels round them
    differently from torch's (docs/formats.md), which layers carry on: the allowance is the quantization's own KL
    plus 0.01. Without them its float32 kernels agree with torch's to about 1e-6: no share, a floor of 1e-3."""

    def __init__(self, path: Path, optimization: str = "all", threads: int = 0, activations: bool = True):
        self.gap_share, self.gap_floor = (1.0, 0.01) if activations else (0.0, 1e-3)
        try:
            import onnxruntime as ort
        except ImportError:
            raise UsageError("running an ONNX file needs onnxruntime: pip install onnxruntime") from None
        so = ort.SessionOptions()
        so.graph_optimization_level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                       "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                                       "off": ort.GraphOptimizationLevel.ORT_DISABLE_ALL}[optimization]
        so.log_severity_level = 3
        self.path = path
        from onnxruntime.capi import onnxruntime_pybind11_state as state

        # (onnxruntime's own exception types, all of them: an error of qtool's or of memory stays what it is)
        self._errors = tuple(t for t in vars(state).values() if isinstance(t, type) and issubclass(t, Exception))
        if threads:
            so.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types (Fail, InvalidGraph, ...)
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "float8" in text and optimization == "all":  # (its fusions of the extended level type-check them)
                raise UsageError(f"{path}: onnxruntime's graph optimizations at level all refuse its float8 Q/DQ "
                                 "nodes: run it with --onnx-optimization basic (or off)") from None
            raise UsageError(f"{path}: onnxruntime cannot load it ({text[:300]})") from None
        self.inputs = [i.name for i in self.session.get_inputs()]
        # the float type each input takes (the export traces float inputs in the model's type, so float64 data
        # that calibrated a model of float32 runs it as float32)
        self._float_inputs = {i.name: _ORT_FLOATS[i.type] for i in self.session.get_inputs() if i.type in _ORT_FLOATS}
        self.name = f"onnxruntime {ort.__version__} (optimizations: {optimization})"

    def _run(self, feed: Dict[str, torch.Tensor]) -> torch.Tensor:
        missing = [n for n in self.inputs if n not in feed]
        if missing:
            raise UsageError(f"the ONNX graph needs inputs {missing} that the evaluation data does not give "
                             f"(it gives {sorted(feed)})")
        arrays = {n: (feed[n].to(self._float_inputs[n]) if n in self._float_inputs and feed[n].is_floating_point()
                      else feed[n]).numpy() for n in self.inputs}
        try:
            out = self.session.run(None, arrays)
        except self._errors as e:  # the graph fails on this batch (a shape it cannot take)
            raise UsageError(f"{self.path}: onnxruntime fails to run it on a batch of shape "
                             f"{[list(a.shape) for a in arrays.values()]}: {cut(' '.join(str(e).split()), 300)}"
                             ) from None
        return torch.from_numpy(out[0]).float()

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        x = torch.tensor([list(ids)], dtype=torch.long)
        return self._run({"input_ids": x, "attention_mask": torch.ones_like(x)})[0]

    def outputs(self, batch: Batch) -> torch.Tensor:
        feed = dict(batch.kwargs)
        if batch.args:
            feed.update({n: a for n, a in zip(self.inputs, batch.args)})
        if "attention_mask" in self.inputs and "attention_mask" not in feed and "input_ids" in feed:
            # (token ids alone, which the export traced with a mask of ones: what the models compute without one)
            feed["attention_mask"] = torch.ones_like(feed["input_ids"])
        return self._run(feed)

    def close(self) -> None:
        self.session = None


def transformers_reload(directory: Path, causal_lm: bool, device: str = "cpu",
                        activations: bool = False, trust_remote_code: bool = False) -> TorchRuntime:
    """A compressed-tensors directory as transformers loads it (compressed-tensors decompresses the weights).
    float32 where the format allows it; FP4 and MX weights decompress to bfloat16 only. ``activations``: the
    encodings quantize activations, which in bfloat16 round differently from qtool's float32 (the allowance).
    ``trust_remote_code``: the model's code travels in the directory (``auto_map``), and runs only when True."""
    try:
        import compressed_tensors  # noqa: F401  (transformers needs it to read the quantization config)
        import transformers
    except ImportError:
        raise UsageError("running a compressed-tensors directory needs transformers and compressed-tensors: "
                         "pip install 'qtool[hf]' compressed-tensors") from None
    import contextlib
    import io

    from ..model.hf import never_asks

    refuse_known_expert_limit(directory)
    own = _architecture_class(directory, transformers)
    # (beside an auto_map, transformers' own architectures[0] class, as qtool built the reference: not the
    # repository's code AutoModelForCausalLM would run under --trust-remote-code)
    auto = own if own is not transformers.AutoModel and _auto_map(directory) else \
        transformers.AutoModelForCausalLM if causal_lm and _auto_causal_lm(directory) else own
    errors = []
    for dtype in (torch.float32, torch.bfloat16):
        try:
            # (compressed-tensors draws its own progress bars; never_asks: no question on stdin)
            with contextlib.redirect_stderr(io.StringIO()), torch.no_grad(), never_asks():
                model, info = auto.from_pretrained(str(directory), dtype=dtype, output_loading_info=True,
                                                   trust_remote_code=trust_remote_code)
                model = model.to(device).eval()  # progress bars, and decompresses on first use
                if causal_lm:  # (other models take other inputs: the held-out batches try them)
                    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
        except (ValueError, RuntimeError, TypeError, OSError, KeyError, NotImplementedError, AttributeError) as e:
            if isinstance(e, AttributeError) and "has no attribute 'weight'" not in str(e):
                raise  # (only the known limit below: any other is a fault to report, not the file's)
            # (transformers says "mismatched sizes" where a fused expert's shape differs, "automatic conversion"
            # where it found no expert to concatenate: Jamba's)
            if any(m in str(e) for m in ("ignore_mismatched_sizes", "automatic conversion of the weights")) and \
                    _experts_apart(directory):
                mixed = _experts_quantized_apart(directory)
                if mixed is not None:  # (the file's own doing, which its export said: not the runtime's limit)
                    raise UsageError(f"{directory}: transformers cannot load its experts, which the export "
                                     f"quantized apart ({mixed}); calibrate a projection's experts alike (one "
                                     "rule), or evaluate qtool's own format of the same calibration") from None
                # (its "above report" is transformers' own log: the message alone names nothing)
                raise UsageError(f"{directory}: transformers cannot load its experts: {_EXPERTS_FUSED}: a limit "
                                 "of the runtime, not the file; evaluate qtool's own format of the same "
                                 "calibration instead") from None
            if "ignore_mismatched_sizes" in str(e) and not _known_limit(directory, [str(e)]):
                # (its "above report" is a log line qtool keeps quiet)
                raise UsageError(_mismatch(directory, auto, dtype, trust_remote_code) or
                                 f"{directory}: transformers cannot load it "
                                 f"({str(e).splitlines()[0][:160]})") from None
            errors.append(f"{str(dtype).replace('torch.', '')}: {str(e).splitlines()[0][:160] if str(e) else type(e).__name__}")
            continue
        _check_loaded(directory, info)
        if _reloads_nvfp4_experts_wrongly(transformers.__version__) and _fused_experts(model) and \
                _experts_apart(directory, r"\.experts\.\d+\..*\.weight_global_scale$"):
            raise UsageError(f"{directory}: transformers {transformers.__version__} reloads NVFP4 experts wrongly "
                             "(it stacks them into its fused "
                             "experts with each value multiplied by the global scale instead of divided): a limit of "
                             "the runtime, not the file; serve it in vLLM, or evaluate qtool's own format of the "
                             "same calibration instead")
        label = "transformers + compressed-tensors" + ("" if dtype == torch.float32 else " (bfloat16)")
        allowance = (0.0, 1e-4) if dtype == torch.float32 else (1.0, 0.01) if activations else (0.25, 0.01)
        return TorchRuntime(model, label, *allowance)
    raise UsageError(f"{directory}: transformers cannot load it ({'; '.join(errors)})" + _known_limit(directory, errors))


def refuse_known_expert_limit(directory: Path) -> None:
    """A directory whose per-expert tensors transformers is known not to reload into its fused experts as the file
    holds them (:func:`~qtool.export.ct_config.transformers_expert_limit`): one line before any load, where the
    load would fail with another reason, or succeed with wrong experts and call the file faulty."""
    from ..export.ct_config import transformers_expert_limit

    from ..families import family_of
    from ..io.jsonfile import read_json_object

    if not _experts_apart(directory) or _experts_quantized_apart(directory) is not None:
        return  # (no experts stored apart; or quantized apart, which its own message says)
    try:
        family = family_of(read_json_object(directory / "config.json", UsageError, "config").get("model_type"))
    except (UsageError, OSError):
        return  # (the load's own error says what is wrong with config.json)
    if family is None or not family.transformers_reads_split_experts:
        return  # (a family qtool does not know: its experts may be real per-expert Linears; one whose transformers
        # model reads no per-expert tensors at all: the load report says so, _check_loaded)
    limit = transformers_expert_limit(quantization_config(directory) or {})
    if limit:
        raise UsageError(f"{directory}: transformers cannot reload its experts as the file holds them: {limit}; "
                         "evaluate qtool's own format of the same calibration instead")


def _mismatch(directory: Path, auto, dtype, trust_remote_code: bool = False) -> Optional[str]:
    """The first tensor whose shape in the file is not the one the directory's config.json makes the model give it
    (transformers says only "look at the above report", a log line), as one line; None where it names none."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()), torch.no_grad():
            _, info = auto.from_pretrained(str(directory), dtype=dtype, ignore_mismatched_sizes=True,
                                           output_loading_info=True, trust_remote_code=trust_remote_code)
    except Exception:  # (a second failure says no more than the first)
        return None
    wrong = sorted(info.get("mismatched_keys") or (), key=lambda m: m[0])
    if not wrong:
        return None
    key, file_shape, model_shape = wrong[0][:3]
    return (f"{directory}: {key} is {list(file_shape)} in the file, and the model its config.json describes takes "
            f"{list(model_shape)}" + (f" ({len(wrong) - 1} more tensors alike)" if len(wrong) > 1 else "") +
            ": the tensors and config.json's quantization_config disagree (one edited since export?)")


def _auto_causal_lm(directory: Path) -> bool:
    """Whether AutoModelForCausalLM builds the directory's model type: it builds Gemma 3's and Mllama's
    multimodal models, not LLaVA's, Qwen2-VL's or Idefics3's (those load by their ``architectures`` class)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ..io.jsonfile import read_json_object

    try:
        model_type = read_json_object(directory / "config.json", UsageError, "Hugging Face config").get("model_type")
    except UsageError:
        return True
    return not isinstance(model_type, str) or model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _auto_map(directory: Path) -> bool:
    """Whether the directory's config.json has an ``auto_map`` (the model's code travels with it)."""
    from ..io.jsonfile import read_json_object

    try:
        return bool(read_json_object(directory / "config.json", UsageError, "Hugging Face config").get("auto_map"))
    except UsageError:
        return False


def _architecture_class(directory: Path, transformers):
    """The class config.json's ``architectures`` names (a classifier keeps its head, T5 its decoder, as the reference
    model qtool loaded has them; remote code's by its ``auto_map``), else ``AutoModel``."""
    from ..io.jsonfile import read_json_object
    from ..model.hf import auto_class_for

    try:
        config = read_json_object(directory / "config.json", UsageError, "Hugging Face config")
    except UsageError:
        config = {}
    names = config.get("architectures")
    found = getattr(transformers, names[0], None) if isinstance(names, list) and names and \
        isinstance(names[0], str) else None
    return found if isinstance(found, type) and hasattr(found, "from_pretrained") else \
        auto_class_for(transformers, names, config.get("auto_map"))


_EXPERTS_FUSED = ("its experts are stored one by one, as vLLM's MoE loaders read them, and transformers' model "
                  "holds them fused: it did not read them into its fused experts")


def _reloads_nvfp4_experts_wrongly(version: str) -> bool:
    """Whether this transformers is one known to reload NVFP4 experts wrongly (5.23 and before, docs/formats.md);
    a later one is measured, so a fixed reload is not refused (and tests/test_experts.py says the limit moved)."""
    import re

    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    return len(parts) == 2 and tuple(parts) <= (5, 23)


def _fused_experts(model) -> bool:
    """Whether a loaded model holds some mixture-of-experts experts as fused 3-D parameters (transformers 5)."""
    from ..model.experts import fused_layout

    return any(fused_layout(m) is not None for m in model.modules())


def _experts_quantized_apart(directory: Path) -> Optional[str]:
    """The export's warning that it quantized one fused layer's experts with more than one scheme (or partly float),
    from the directory's manifest.json, or None."""
    from ..io.jsonfile import read_json_object

    try:
        summary = read_json_object(directory / "manifest.json", UsageError, "manifest").get("summary") or {}
    except (UsageError, OSError):
        return None
    from ..export.ct_config import FUSED_MIX_NOTE

    warnings = summary.get("export_warnings") if isinstance(summary, dict) else None
    said = next((w for w in warnings or () if isinstance(w, str) and "and transformers:" in w
                 and FUSED_MIX_NOTE in w), None)
    return None if said is None else said.split(f" {FUSED_MIX_NOTE}")[0].split(": ", 1)[-1]


def _experts_apart(directory: Path, pattern: str = r"\.experts\.\d+\.") -> bool:
    """Whether a directory's weights store mixture-of-experts experts one by one (``...experts.3.up_proj...``;
    ``pattern``: a tensor name of theirs to look for)."""
    import re

    return any(re.search(pattern, k) for k in _tensor_names(directory))


def _tensor_names(directory: Path) -> set:
    """The names of the tensors a directory's safetensors files hold (empty where they cannot be read)."""
    from safetensors import safe_open

    from ..io.checkpoint import tensor_files

    names: set = set()
    try:
        for f in tensor_files(Path(directory)):
            with safe_open(str(f), "pt") as fh:
                names.update(fh.keys())
    except Exception:  # (a damaged file: the load's own error stands)
        return set()
    return names


def _check_loaded(directory: Path, info: dict) -> None:
    """Refuse a load in which transformers left parameters unread (it would run them at their initial values, and
    the figures would blame the file): a model whose experts transformers holds fused while the file stores them
    per expert, as llm-compressor does for vLLM (gpt-oss, GraniteMoE)."""
    missing, unused = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if not missing:
        return
    names = _tensor_names(directory)
    absent = [k for k in missing if k not in names] if names else []
    if absent and not unused:  # (nothing in the file went unread: the tensors are not there)
        more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
        raise UsageError(f"{directory}: the file holds no {absent[0]!r}{more} of the model: not a whole export "
                         "of it")
    # a parameter the file holds quantized (its weight_packed / weight_scale unread) while config.json's
    # quantization_config leaves it float (its ignore list names it): the file disagrees with itself
    stems = {k.rsplit(".", 1)[0] for k in missing if k.endswith(".weight")}
    packed = [k for k in unused if k.rsplit(".", 1)[0] in stems and k.rsplit(".", 1)[1].startswith("weight_")]
    if packed:
        layer = packed[0].rsplit(".", 1)[0]
        raise UsageError(f"{directory}: the file holds {layer} quantized ({packed[0].rsplit('.', 1)[1]}), and "
                         "config.json's quantization_config leaves it float (its ignore list?): the tensors and "
                         "config.json disagree (one edited since export?)")
    experts = f" ({_EXPERTS_FUSED})" if any(".experts." in k for k in unused) else ""
    raise UsageError(f"{directory}: transformers leaves {len(missing)} parameters of this model unread "
                     f"({', '.join(missing[:2])}{' ...' if len(missing) > 2 else ''}){experts}: a limit of the "
                     "runtime, not the file; evaluate qtool's own format of the same calibration instead")


def _known_limit(directory: Path, errors=()) -> str:
    """Why transformers cannot load a directory where that is a known limit of the runtime, not of the file: an
    asymmetric ``pack-quantized`` checkpoint (compressed-tensors 0.20 compresses transformers' empty model with
    the zero points left unpacked, ``[out, groups]``, while the format stores them packed, as its own compress on
    real tensors does: llm-compressor issue #1618); a model whose own loading code reads a quantized Linear's
    ``weight`` (T5's, Mamba's and Falcon's weight initialization), which compressed-tensors replaced."""
    if any("object has no attribute 'weight'" in e for e in errors):
        return ("; this model's own transformers code reads a Linear's weight while loading, where a packed "
                "Linear holds weight_packed (T5, Mamba, Falcon): a limit of the runtime, not the file (8-bit int-quantized "
                "weights load); evaluate qtool's own format of the same calibration instead")
    config = quantization_config(directory) or {}
    groups = (config.get("config_groups") or {}).values()
    if config.get("format") == "pack-quantized" and any(
            not ((g.get("weights") or {}).get("symmetric", True)) for g in groups if isinstance(g, dict)):
        return ("; transformers with compressed-tensors cannot load asymmetric pack-quantized weights (it expects "
                "the zero points unpacked; llm-compressor issue #1618): a limit of the runtime, not the file. Serve "
                "it in vLLM, or quantize symmetric weights to check it in transformers")
    return ""
