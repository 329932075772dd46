"""What a GGUF file says about the model besides its tensors: the architecture's hyperparameters, its tensor names
and the tokenizer, read from a Hugging Face directory (``config.json``, ``tokenizer.json``).

Supported: the model families with a GGUF architecture (``qtool.families``: each family file says what
llama.cpp's converter writes for it, checks the config against what llama.cpp computes, and transforms tensors as
the converter does — q/k rows permuted for ``llama``, Gemma's norms shifted by one). Tensor names are gguf-py's
(``TensorNameMap``). A mixture-of-experts model's per-expert tensors (``experts.<e>.gate_proj.weight``) are
stacked into llama.cpp's 3-D expert tensors (``ffn_gate_exps``: one ``[out, in]`` slice per expert), its router is
``ffn_gate_inp``, and the expert counts and widths go to the metadata as llama.cpp's converter writes them.
Tokenizers: byte-level BPE (``gpt2`` in GGUF; SmolLM, Llama 3, Qwen2) and byte-fallback BPE
(``llama``; Llama 2, Mistral). Anything else is refused with one line. The vocabulary and special tokens are read
with the ``gguf`` package's own readers (``gguf.vocab``), as llama.cpp's converter does.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..errors import CheckpointError
from ..families import Family, family_of, gguf_model_types
from ..families.base import TensorPart
from ..io.jsonfile import read_json_object

__all__ = ["GgufModel", "read_gguf_model", "permute_rows"]

# a checkpoint's per-expert tensor: llama.cpp stacks experts <stem>.<e>.<leaf> into one tensor named for <stem>.<leaf>
EXPERT_KEY = re.compile(r"^(?P<stem>.+\.experts)\.(?P<expert>\d+)\.(?P<leaf>[^.]+)\.(?P<kind>weight|bias)$")

# llama.cpp's pre-tokenizer names, recognized from tokenizer.json's pre_tokenizer (llama.cpp src/llama-vocab.cpp):
# "gpt-2" is the GPT-2 split regex alone, "smollm" splits digits one by one first, "llama-bpe" (Llama 3) and
# "qwen2" use a Split regex that differs in how digits group (\p{N}{1,3} against single \p{N}).
_LLAMA3_DIGITS = r"\p{N}{1,3}"
_QWEN2_DIGITS = r"|\p{N}|"


def model_name(directory: Path) -> str:
    """``general.name``: the model directory's own name however the path was spelled (".", a symlink), and a Hugging
    Face cache snapshot's repository name (``models--org--name/snapshots/<commit>``: ``name``), not its commit."""
    real = Path(directory).resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent.name.split("--")[-1]
    return real.name


def permute_rows(t, n_head: int):
    """llama.cpp's rotary layout for q/k projections: within each head, the two halves of the rotary pairs are
    interleaved (``reshape(n_head, 2, rows / n_head / 2, ...)``, swap the middle axes). Works on anything indexed
    by rows first: weights, biases, codes, per-row block scales."""
    rows = t.shape[0]
    if rows % (2 * n_head):
        raise CheckpointError(f"cannot permute {rows} rows for {n_head} heads (rows must divide into head pairs)")
    return t.reshape(n_head, 2, rows // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


@functools.lru_cache(maxsize=8)
def _name_map(arch_name: str, n_layers: int):
    """gguf-py's checkpoint-name → GGUF-name table for one architecture (building it takes ~25 ms: once per model,
    not once per tensor)."""
    import gguf

    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name)
    return gguf.get_tensor_name_map(arch, n_layers)


@dataclass
class GgufModel:
    """One Hugging Face directory's GGUF description."""

    directory: Path
    config: Dict[str, Any]  # config.json as the family checked it
    family: Family
    arch: str  # GGUF architecture name
    permute_qk: bool
    n_layers: int
    n_head: int
    n_head_kv: int
    tied: bool

    def tensor_name(self, key: str) -> Optional[str]:
        """The GGUF name of checkpoint tensor ``key`` (None for buffers llama.cpp recomputes, e.g. rotary
        frequencies); raises ``CheckpointError`` for a tensor llama.cpp has no place for."""
        if key.endswith("rotary_emb.inv_freq") or self.family.gguf_skip(key):
            return None
        expert = EXPERT_KEY.match(key)
        if expert is not None:  # one expert's slice of llama.cpp's stacked tensor
            key = f"{expert['stem']}.{expert['leaf']}.{expert['kind']}"
        name = _name_map(self.arch, self.n_layers).get_name(self.family.gguf_key(key),
                                                               try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CheckpointError(f"{self.directory}: tensor {key!r} has no place in a GGUF {self.arch} model")
        return name

    def matrix(self, model, modules, module: str) -> Tuple[Optional[str], int]:
        """``(GGUF tensor name, row)`` of Linear ``module``'s weight in ``model`` (``modules``: its
        ``dict(named_modules())``): looked up by the checkpoint's key (Mixtral's experts are stored under
        ``block_sparse_moe``); the row is the expert's in a stacked expert tensor, else 0. Raises as
        :meth:`tensor_name` does."""
        from ..model.experts import checkpoint_key, routing_of

        name = self.tensor_name(checkpoint_key(model, f"{module}.weight") or f"{module}.weight")
        return name, (routing_of(modules, module) or (None, 0))[1]

    def parts(self, key: str) -> Optional[List[TensorPart]]:
        """The GGUF tensors llama.cpp's converter makes from parts of ``key`` (None: written whole)."""
        return self.family.gguf_parts(key, self.config)

    def permutation(self, key: str) -> Optional[int]:
        """The head count to permute ``key``'s rows with (q and k projections of a permuted arch), else None."""
        if not self.permute_qk:
            return None
        if key.endswith(("q_proj.weight", "q_proj.bias")):
            return self.n_head
        if key.endswith(("k_proj.weight", "k_proj.bias")):
            return self.n_head_kv
        return None

    # ---- metadata -------------------------------------------------------------------------------------------
    def add_metadata(self, writer, file_type: int, vocab_size: int) -> List[str]:
        """Hyperparameters and tokenizer onto ``writer``; returns warnings (e.g. an unknown pre-tokenizer)."""
        import gguf

        writer.add_name(model_name(self.directory))
        writer.add_type(gguf.GGUFType.MODEL)
        self.family.add_gguf_metadata(writer, self.config, self.n_layers)
        writer.add_vocab_size(vocab_size)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        return self.family.gguf_warnings(self.config) + _add_tokenizer(writer, self.directory, vocab_size)

    def check_tokenizer(self) -> None:
        """Read the tokenizer as :meth:`add_metadata` will, onto a writer that is never written, so a fault in
        it is one line before calibration instead of after it (skipped when config.json gives no usable
        ``vocab_size``: the embedding rows are only known once the weights are read; its presence is checked
        even then)."""
        import gguf

        _tokenizer_path(self.directory)
        rows = self.config.get("vocab_size")
        if isinstance(rows, int) and not isinstance(rows, bool) and 0 < rows <= 2**24:
            _add_tokenizer(gguf.GGUFWriter(None, self.arch), self.directory, rows)


def read_gguf_model(directory: Path) -> GgufModel:
    """Read ``config.json``; raises ``CheckpointError`` (one line) for anything GGUF export cannot describe."""
    directory = Path(directory)
    if not directory.is_dir() or not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: GGUF export needs a Hugging Face model directory (config.json, "
                              "tokenizer.json and the weights)")
    config = read_json_object(directory / "config.json", CheckpointError, "Hugging Face config")
    model_type = config.get("model_type")
    family = family_of(model_type)
    if family is None or family.gguf_arch is None:
        raise CheckpointError(f"{directory}: model_type {str(model_type)[:40]!r} has no GGUF export in qtool "
                              f"(supported: {', '.join(gguf_model_types())})")
    config = family.check_gguf(config, directory / "config.json")
    heads = int(config["num_attention_heads"])
    return GgufModel(directory, config, family, family.gguf_arch, family.permute_qk, int(config["num_hidden_layers"]),
                     heads, int(config["num_key_value_heads"]), bool(config.get("tie_word_embeddings")))


# --------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------
def _pre_tokenizer(tokenizer_json: Dict[str, Any]) -> Optional[str]:
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    types = [p.get("type") for p in parts]
    if types == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if types == ["Digits", "ByteLevel"] and parts[0].get("individual_digits") and parts[1].get("use_regex", True):
        return "smollm"
    if types and types[0] == "Split":
        pattern = str((parts[0].get("pattern") or {}).get("Regex", ""))
        if _LLAMA3_DIGITS in pattern:
            return "llama-bpe"
        if _QWEN2_DIGITS in pattern:
            return "qwen2"
    return None


def _tokenizer_path(directory: Path) -> Path:
    """``directory``'s tokenizer.json; a ``CheckpointError`` when there is none."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: GGUF export needs the tokenizer (tokenizer.json); save it with "
                              "tokenizer.save_pretrained() beside the model")
    return path


# what gguf-py's vocabulary readers raise on a damaged tokenizer file (they index and decode without checks)
_TOKENIZER_FAULTS = (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError,
                     OverflowError, AssertionError)


def _add_tokenizer(writer, directory: Path, n_vocab: int) -> List[str]:
    """The tokenizer (tokenizer.json and the special tokens of tokenizer_config.json / special_tokens_map.json)
    onto ``writer``, read with gguf-py's own readers as llama.cpp's converter does; every fault in those files is
    one ``CheckpointError`` line naming the tokenizer."""
    path = _tokenizer_path(directory)
    tj = read_json_object(path, CheckpointError, "tokenizers JSON file")
    for side in ("tokenizer_config.json", "special_tokens_map.json"):  # one line for a broken file, not a trace
        if (directory / side).exists():
            read_json_object(directory / side, CheckpointError, f"tokenizer file ({side})")
    try:
        model = tj["model"]
        byte_fallback = bool(model.get("byte_fallback", False))
        kind = model["type"]
    except (KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a tokenizers JSON file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:80] if str(e) else ''})") from None
    if kind != "BPE":
        raise CheckpointError(f"{path}: a {str(kind)[:40]} tokenizer has no GGUF export in qtool (byte-level or "
                              "byte-fallback BPE only)")
    try:
        return _write_tokenizer(writer, directory, tj, byte_fallback, n_vocab)
    except CheckpointError:
        raise
    except _TOKENIZER_FAULTS as e:
        why = str(e).splitlines()[0][:120] if str(e) else ""
        raise CheckpointError(f"{path}: tokenizer not usable for GGUF ({type(e).__name__}: {why})") from None


def _looks_special(text: str) -> bool:
    """Added tokens llama.cpp's converter makes control tokens though tokenizer.json does not mark them special."""
    return (text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<\uff5c") and text.endswith("\uff5c>"))
            or (text.startswith("<unused") and text.endswith(">")))


def _type_added_tokens(types: List[int], tj: Dict[str, Any]) -> None:
    """Each of tokenizer.json's added tokens typed as llama.cpp's converter types it: CONTROL when it is special
    (or looks it), USER_DEFINED otherwise, including added tokens the base vocabulary also holds (gguf-py's reader
    leaves those NORMAL, and llama.cpp then warns that a control-looking token is not control-type)."""
    import gguf

    for added in tj.get("added_tokens") or []:
        if not isinstance(added, dict):
            continue
        i, text = added.get("id"), added.get("content")
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(types) and isinstance(text, str):
            special = added.get("special") is True or _looks_special(text)
            types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)


def _write_tokenizer(writer, directory: Path, tj: Dict[str, Any], byte_fallback: bool, n_vocab: int) -> List[str]:
    import gguf
    from gguf.vocab import BpeVocab, LlamaHfVocab, SpecialVocab

    path = directory / "tokenizer.json"
    warnings: List[str] = []
    if not byte_fallback:
        vocab, pre = BpeVocab(directory), _pre_tokenizer(tj)
        if pre is None:
            pre = "default"
            warnings.append(f"{path}: pre-tokenizer not recognized; llama.cpp will split text with its default "
                            "rules, so its token ids may differ from transformers' on some text")
    else:
        vocab, pre = LlamaHfVocab(directory), "default"
    tokens, scores, types = [], [], []
    for text, score, ttype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(int(ttype))
    if not byte_fallback:
        _type_added_tokens(types, tj)
    if len(tokens) > n_vocab:
        raise CheckpointError(f"{path}: {len(tokens)} tokens, more than the model's {n_vocab} embedding rows")
    for i in range(len(tokens), n_vocab):  # rows the tokenizer does not use (vocab padded for speed)
        tokens.append(f"[PAD{i}]")
        scores.append(-1000.0)
        types.append(int(gguf.TokenType.UNUSED))
    writer.add_tokenizer_model(vocab.tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if vocab.tokenizer_model == "llama":
        writer.add_token_scores(np.asarray(scores, dtype=np.float32).tolist())
    writer.add_token_types(types)
    SpecialVocab(directory, load_merges=vocab.tokenizer_model == "gpt2", n_vocab=n_vocab).add_to_gguf(writer,
                                                                                                      quiet=True)
    return warnings
