"""Calibration data: tensor files and text, turned into deterministic batches of model inputs.

A batch is a ``Batch``: positional tensors (``args``) and keyword tensors (``kwargs``), called as
``model(*args, **kwargs)``. Tensor files with one array give a positional input; several named arrays give keyword
inputs (``input_ids``, ``attention_mask``, ...). Text goes through the checkpoint's tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .errors import DataError, UsageError, not_utf8, out_of_memory

__all__ = ["Batch", "CalibrationData", "load_data", "data_files", "text_samples", "TENSOR_SUFFIXES", "TEXT_SUFFIXES"]

TENSOR_SUFFIXES = (".safetensors", ".pt", ".pth", ".npy", ".npz")
TEXT_SUFFIXES = (".txt", ".jsonl")


@dataclass
class Batch:
    args: Tuple[torch.Tensor, ...] = ()
    kwargs: Dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device) -> "Batch":
        return Batch(tuple(a.to(device) for a in self.args), {k: v.to(device) for k, v in self.kwargs.items()})

    @property
    def size(self) -> int:
        first = self.args[0] if self.args else next(iter(self.kwargs.values()))
        return int(first.shape[0]) if first.dim() else 1


@dataclass
class CalibrationData:
    batches: List[Batch]
    files: List[Path]
    num_samples: int
    description: str
    first: int = 0  # global index of the first batch (a rank's shard in a distributed run starts later)
    available: int = 0  # the samples the data gives, of which --num-samples chose num_samples (0: not known)
    source: str = ""  # --data as given: errors about a batch name it
    sha256: Dict[str, str] = field(default_factory=dict)  # each file's, as read (filled by a run that records them)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


# --------------------------------------------------------------------------------------------------------------
# Tensor files
# --------------------------------------------------------------------------------------------------------------
_WIDENED = (torch.uint16, torch.uint32)  # read as int64: unsigned types torch's operations mostly refuse


def _read_tensor_file(path: Path) -> Dict[str, torch.Tensor]:
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            from .io.checkpoint import check_safetensors

            try:
                check_safetensors(path)
            except Exception as e:
                raise DataError(str(e)) from None
            return dict(load_file(str(path)))
        if suffix in (".pt", ".pth"):
            try:
                with warnings.catch_warnings():  # (torch's "sparse CSR support is in beta" as it rebuilds one)
                    warnings.simplefilter("ignore")
                    obj = torch.load(str(path), map_location="cpu", weights_only=True)
            except Exception as e:  # (torch's advice, "re-run with weights_only=False", is no way to read data)
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                first = ("not a torch file of tensors (torch.save of a tensor or a dict of tensors)"
                         if "Weights only load failed" in first else f"not a readable torch file ({first})")
                raise DataError(f"{path}: cannot read calibration data: {first}") from None
            if isinstance(obj, torch.Tensor):
                return {"input": obj}
            other = ([k for k, v in obj.items() if not isinstance(v, torch.Tensor)] if isinstance(obj, dict)
                     else None)
            named = [k for k in obj if not isinstance(k, str)] if isinstance(obj, dict) else []
            if named:  # (a tensor's name is what a model's argument is: an int key crashed every reader)
                raise DataError(f"{path}: the dict's keys name the model's inputs, and key {named[0]!r} is of type "
                                f"{type(named[0]).__name__}, not a string")
            if other == []:
                return dict(obj)
            if other:
                raise DataError(f"{path}: expected a tensor or a dict of tensors, and key {other[0]!r} holds a "
                                f"{type(obj[other[0]]).__name__}")
            raise DataError(f"{path}: expected a tensor or a dict of tensors, found {type(obj).__name__}")
        import numpy as np

        magic, kind = (b"\x93NUMPY", "NumPy header") if suffix == ".npy" else (b"PK", "zip archive")
        with open(path, "rb") as f:  # np.load takes anything else for a pickle, and says so
            if f.read(len(magic)) != magic:
                raise DataError(f"{path}: not a NumPy {suffix} file (no {kind})")
        if suffix == ".npy":
            return {"input": torch.from_numpy(np.load(str(path), allow_pickle=False))}
        with np.load(str(path), allow_pickle=False) as z:
            return {k: torch.from_numpy(z[k]) for k in z.files}
    except DataError:
        raise
    except Exception as e:  # each reader has its own error types
        raise DataError(f"{path}: cannot read calibration data: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _check_finite(name: str, t: torch.Tensor, where: str) -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise DataError(f"{where}: tensor {name!r} has {bad} NaN/Inf values; the data a model runs on must be finite")


def _tensor_samples(files: Sequence[Path]) -> Tuple[List[Dict[str, torch.Tensor]], List[str]]:
    """Concatenate every file's arrays along dim 0; all files must share names and trailing shapes."""
    parts: Dict[str, List[torch.Tensor]] = {}
    names: Optional[List[str]] = None
    for f in files:
        tensors = _read_tensor_file(f)
        if not tensors:
            raise DataError(f"{f}: holds no tensors")
        if names is None:
            names = list(tensors)
        elif sorted(tensors) != sorted(names):
            raise DataError(f"{f}: has tensors {sorted(tensors)}, but earlier files have {sorted(names)}")
        for k, t in tensors.items():
            if t.layout != torch.strided:  # (a sparse tensor crashed the finiteness check: exit 3)
                raise DataError(f"{f}: tensor {k!r} is {str(t.layout).replace('torch.', '')}: save it dense "
                                "(x.to_dense())")
            if t.dim() == 0:
                raise DataError(f"{f}: tensor {k!r} is a scalar; calibration tensors need a batch dimension")
            if 0 in t.shape[1:]:  # (the model's own words were torch's "cannot reshape tensor of 0 elements")
                raise DataError(f"{f}: tensor {k!r} has samples of shape {list(t.shape[1:])}, which hold no values "
                                "(token ids of 0 tokens per sample?)")
            if t.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool) + _WIDENED:
                raise DataError(f"{f}: tensor {k!r} has unsupported dtype {t.dtype}")
            if t.dtype in _WIDENED or (k.endswith("input_ids") and t.dtype in (torch.int16, torch.int8, torch.uint8)):
                t = t.long()  # (token files are often uint16; torch's embedding takes int64 or int32 ids only)
            _check_finite(k, t, str(f))
            if parts.get(k) and parts[k][0].dtype != t.dtype:  # (torch.cat promoted them: bool files became id 1)
                raise DataError(f"{f}: tensor {k!r} is {str(t.dtype).replace('torch.', '')}, and earlier files' is "
                                f"{str(parts[k][0].dtype).replace('torch.', '')}: save every file's tensors alike")
            if parts.get(k) and tuple(parts[k][0].shape[1:]) != tuple(t.shape[1:]):
                raise DataError(
                    f"{f}: tensor {k!r} has sample shape {list(t.shape[1:])}, earlier files have "
                    f"{list(parts[k][0].shape[1:])}"
                )
            parts.setdefault(k, []).append(t)
    assert names is not None
    joined = {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}
    n = {k: v.shape[0] for k, v in joined.items()}
    if len(set(n.values())) != 1:
        raise DataError(f"{files[0]}: named tensors have different sample counts {n}")
    count = next(iter(n.values()))
    ids, mask = joined.get("input_ids"), joined.get("attention_mask")
    if ids is not None and mask is not None:  # (one mask value per token, 0 or 1: a wider mask, or 2s, counted
        if mask.shape != ids.shape:           # tokens the model never saw)
            raise DataError(f"{files[0]}: attention_mask of shape {list(mask.shape)} beside input_ids of shape "
                            f"{list(ids.shape)}: one mask value per token")
        if mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
            raise DataError(f"{files[0]}: attention_mask holds values other than 0 and 1 (e.g. "
                            f"{mask[(mask != 0) & (mask != 1)].flatten()[0].item()}): 1 keeps a token, 0 leaves it out")
    samples = [{k: joined[k][i] for k in names} for i in range(count)]
    return samples, names


# --------------------------------------------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------------------------------------------
def text_samples(path: Path) -> List[str]:
    """Paragraphs of a ``.txt`` file (blank-line separated) or the ``text`` field of each ``.jsonl`` line."""
    jsonl = path.suffix.lower() == ".jsonl"
    try:  # (.jsonl lines split at \n only: a raw \r is JSON whitespace, which universal newlines made a line break)
        with open(path, encoding="utf-8-sig", newline="" if jsonl else None) as fh:
            raw = fh.read()  # (a byte-order mark, as some editors write, is not text)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read text: {e}") from None
    if jsonl:
        out = []
        for i, line in enumerate(raw.split("\n"), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, RecursionError) as e:
                raise DataError(f"{path}:{i}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}:{i}: each line needs a string field 'text'")
            if obj["text"].strip():
                out.append(obj["text"])
        return out
    # (a line of spaces or tabs is a blank line too: editors leave them, and a reader sees a paragraph break)
    return [" ".join(p.split()) for p in re.split(r"\n[^\S\n]*\n", raw) if p.strip()]


def _tokenize(texts: List[str], tokenizer, seq_len: int, where: str) -> List[Dict[str, torch.Tensor]]:
    """One sample per text, truncated/padded to ``seq_len`` (encoders: a sample is a sentence or paragraph)."""
    if tokenizer is None:
        raise DataError(f"{where}: text data needs a tokenizer, and this checkpoint has none")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    special = tokenizer.num_special_tokens_to_add() if hasattr(tokenizer, "num_special_tokens_to_add") else 0
    if seq_len <= special:  # (the tokenizer's own error: "Unable to create tensor, ... activate truncation")
        raise DataError(f"{where}: --seq-len {seq_len} leaves no room for text beside the tokenizer's {special} "
                        f"special tokens: use --seq-len {special + 1} or more")
    enc = tokenizer(texts, truncation=True, max_length=seq_len, padding="max_length", return_tensors="pt")
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    return [{k: enc[k][i] for k in keys} for i in range(len(texts))]


def _pack(texts: List[str], tokenizer, seq_len: int, where: str) -> List[Dict[str, torch.Tensor]]:
    """Causal LMs: the texts as one token stream (EOS between them) cut into full ``seq_len`` windows, each
    opened by the BOS token where the tokenizer starts a text with one (Llama, Gemma, Mistral: as llama.cpp's
    perplexity and imatrix open each chunk; the first position carries activations no other position has)."""
    if tokenizer is None:
        raise DataError(f"{where}: text data needs a tokenizer, and this checkpoint has none")
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    bos = _opening_bos(tokenizer)
    body = seq_len - len(bos)
    if body < 1:
        raise DataError(f"{where}: --seq-len {seq_len} leaves no room for text after the BOS token each window "
                        f"opens with: use --seq-len {len(bos) + 1} or more")
    stream: List[int] = []
    for t in texts:
        stream += _token_ids(tokenizer, t) + sep
    n = len(stream) // body
    if n == 0:
        raise DataError(f"{where}: {len(stream)} tokens of text make no full sequence of --seq-len {seq_len}")
    ids = torch.tensor(stream[: n * body], dtype=torch.long).reshape(n, body)
    if bos:
        ids = torch.cat([torch.full((n, 1), bos[0], dtype=torch.long), ids], dim=1)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(seq_len, dtype=torch.long)} for i in range(n)]


_PIECE_CHARS = 100_000  # a longer paragraph is tokenized in pieces of at most this many characters


def _token_ids(tokenizer, text: str) -> List[int]:
    """``text``'s token ids without special tokens, tokenized in pieces of at most ``_PIECE_CHARS`` characters cut
    before a space: a fast tokenizer given one 50 MB paragraph held about 130 bytes per character (6.6 GB); in
    pieces, the ids alone. Byte-level BPE tokenizers (GPT-2's, SmolLM2's, Llama 3's) give the same ids either way
    (a word's leading space starts the next piece); a SentencePiece one may differ by a token at a cut."""
    if len(text) <= _PIECE_CHARS:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    ids: List[int] = []
    start = 0
    while start < len(text):
        end = len(text) if start + _PIECE_CHARS >= len(text) else text.rfind(" ", start + 1, start + _PIECE_CHARS)
        end = end if end > start else start + _PIECE_CHARS  # (no space in the piece: cut anywhere)
        ids += tokenizer(text[start:end], add_special_tokens=False)["input_ids"]
        start = end
    return ids


def _opening_bos(tokenizer) -> List[int]:
    """``[bos_token_id]`` where the tokenizer puts it before a text of its own accord, else ``[]``."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    try:
        first = tokenizer("a")["input_ids"][:1]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: no BOS, as before
        return []
    return [bos] if first == [bos] else []


# --------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------
def _collect(path: Path) -> Tuple[List[Path], str]:
    if not path.exists():
        raise DataError(f"{path}: data path not found")
    if not path.is_dir() and not path.is_file():  # (a FIFO: read once for the batches, its hash then waited forever)
        raise DataError(f"{path}: not a regular file or a directory (a pipe or a device is read only once): write "
                        "the data to a file")
    if path.is_dir():
        # hidden files are not data: macOS's ._a.txt metadata, an editor's .#a.txt lock (a dangling link), .a.txt.swp
        entries = [p for p in path.iterdir() if not p.name.startswith(".")]
        broken = sorted(p for p in entries if p.is_symlink() and not p.exists())
        if broken:  # (skipped, the run would use the other files without a word)
            raise DataError(f"{broken[0]}: a link to nothing (its target is missing, or the links loop)")
        files = sorted(p for p in entries if p.is_file() and p.suffix.lower() in TENSOR_SUFFIXES + TEXT_SUFFIXES)
        for f in files:  # (the manifest names every file read, in JSON, which holds UTF-8 names)
            shown = not_utf8(f.name)
            if shown is not None:
                raise DataError(f"{path / shown}: not a valid UTF-8 name; the manifest names every data file in "
                                "UTF-8: rename it")
        if not files:
            raise DataError(f"{path}: no data files (expected {', '.join(TENSOR_SUFFIXES + TEXT_SUFFIXES)})")
    else:
        files = [path]
    kinds = {"text" if f.suffix.lower() in TEXT_SUFFIXES else "tensor" for f in files}
    unknown = [f for f in files if f.suffix.lower() not in TENSOR_SUFFIXES + TEXT_SUFFIXES]
    if unknown:
        raise DataError(f"{unknown[0]}: unknown data file type (expected {', '.join(TENSOR_SUFFIXES + TEXT_SUFFIXES)})")
    if len(kinds) > 1:
        raise DataError(f"{path}: mixes text and tensor files; use one kind per data directory")
    return files, kinds.pop()


def check_data(path: Union[str, Path, None]) -> None:
    """Refuse before any model loads what :func:`load_data` would refuse of ``path`` without a tokenizer: a path
    that is missing or of an unknown kind, text and tensors mixed, text that cannot be read (not UTF-8, a ``.jsonl``
    line without ``text``) or holds no sample. Tensor files are read once, by ``load_data``."""
    if path is None:
        return
    files, kind = _collect(Path(path))
    if kind == "text" and not any([text_samples(f) for f in files]):
        raise DataError(f"{path}: no text samples (empty file?)")


def data_files(path: Union[str, Path]) -> List[Path]:
    """The files ``--data PATH`` reads: the file, or a directory's data files (by suffix); DataError otherwise."""
    return _collect(Path(path))[0]


def load_data(
    path: str | Path,
    batch_size: int = 8,
    num_samples: Optional[int] = None,
    seed: int = 0,
    seq_len: int = 128,
    tokenizer: Any = None,
    pack_text: bool = False,
    at_most: bool = False,
) -> CalibrationData:
    """Read ``path`` (file or directory), pick a deterministic subset, and cut it into batches.

    Text: one sample per paragraph (``.txt``, blank-line separated) or line (``.jsonl``), padded to ``seq_len``;
    with ``pack_text`` (causal LMs) the texts are joined into one token stream cut into full ``seq_len`` windows,
    and ``num_samples`` counts windows. ``at_most``: ``num_samples`` is an upper bound (all of a smaller file),
    not a count to refuse a smaller file for.
    """
    path = Path(path)
    if batch_size < 1:
        raise DataError(f"--batch-size must be at least 1 (got {batch_size})")
    if num_samples is not None and num_samples < 1:
        raise DataError(f"--num-samples must be at least 1 (got {num_samples})")
    if seq_len < 1:
        raise DataError(f"--seq-len must be at least 1 (got {seq_len})")
    files, kind = _collect(path)
    if kind == "text":
        texts: List[str] = []
        for f in files:
            texts += text_samples(f)
        if not texts:
            raise DataError(f"{path}: no text samples (empty file?)")
        if pack_text:
            windows = _pack(texts, tokenizer, seq_len, str(path))
            order = _subset(len(windows), num_samples, seed, at_most,
                            f"{path} packs into only {len(windows)} windows of {seq_len} tokens")
            samples = [windows[i] for i in order]
            desc, available = f"{len(order)} windows of {seq_len} tokens of packed text", len(windows)
        else:
            order = _subset(len(texts), num_samples, seed, at_most, f"{path} holds only {len(texts)} text samples")
            samples = _tokenize([texts[i] for i in order], tokenizer, seq_len, str(path))
            desc, available = f"{len(order)} text samples tokenized to {seq_len} tokens", len(texts)
        names = list(samples[0])
    else:
        all_samples, names = _tensor_samples(files)
        if not all_samples:
            raise DataError(f"{path}: no samples (tensors have a batch dimension of 0)")
        order = _subset(len(all_samples), num_samples, seed, at_most,
                        f"{path} holds only {len(all_samples)} samples")
        samples = [all_samples[i] for i in order]
        desc, available = f"{len(order)} tensor samples", len(all_samples)
    batches = []
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        stacked = {k: torch.stack([s[k] for s in chunk]) for k in names}
        if kind == "tensor" and len(names) == 1:
            batches.append(Batch(args=(stacked[names[0]],)))
        else:
            batches.append(Batch(kwargs=stacked))
    return CalibrationData(batches, files, len(samples), desc, available=available, source=str(path))


def _subset(total: int, num_samples: Optional[int], seed: int, at_most: bool, what: str) -> List[int]:
    """The first ``num_samples`` of a seeded permutation; all samples, in order, without ``num_samples`` (or, with
    ``at_most``, when there are no more). Otherwise asking for more samples than ``what`` holds is refused rather
    than silently given fewer."""
    if not 0 <= seed < 2**64:
        raise UsageError(f"--seed must be an integer from 0 to 2**64 - 1 (got {str(seed)[:40]})")
    if at_most and num_samples is not None:
        num_samples = min(num_samples, total)
    if num_samples is not None and num_samples > total:
        raise DataError(f"--num-samples {num_samples}: {what}; pass at most {total}, or leave --num-samples out to "
                        "use them all")
    if num_samples is None or num_samples == total:
        return list(range(total))
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(total, generator=g)[:num_samples].tolist())


def positions_of(config) -> Optional[int]:
    """The positions a model's config (a transformers config, or config.json's mapping) says it was trained for:
    ``max_position_embeddings`` or GPT-2's ``n_positions``, as written (XLNet's -1: no limit); None where neither."""
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    return next((get(k) for k in ("max_position_embeddings", "n_positions") if isinstance(get(k), int)), None)


def past_positions(config, tokens: int, files: Sequence[Path] = ()) -> Optional[str]:
    """A warning where samples of ``tokens`` tokens run past the positions the model's ``config`` was trained
    for (a rotary model runs on past them without an error; a learned table's refusal is :func:`rejection`'s);
    ``files``: the data's, whose kind says what shortens a sample (--seq-len cuts text, not token-id files)."""
    positions = positions_of(config)
    if positions is None or positions <= 0 or tokens <= positions:  # (XLNet's -1: no limit)
        return None
    text = not files or any(Path(f).suffix.lower() in TEXT_SUFFIXES for f in files)
    how = (f"pass --seq-len {positions} or less" if text else f"save token samples of at most {positions}")
    return (f"samples of {tokens} tokens run past the model's {positions} positions (max_position_embeddings): what "
            f"is measured there describes positions the model was not trained for; {how}")


def ids_like(x: torch.Tensor) -> bool:
    """Whether a batch's lone input tensor reads as token ids: integers (not bytes or booleans) of one or two
    dimensions; a uint8 tensor, or an integer one of three or four dimensions, is images."""
    return not x.is_floating_point() and x.dtype not in (torch.uint8, torch.bool) and 1 <= x.dim() <= 2


def longest_sample(batches) -> int:
    """The most tokens of any sample of ``batches`` (0 where they hold no token ids, :func:`ids_like`)."""
    longest = 0
    for b in batches:
        ids = b.kwargs.get("input_ids", b.args[0] if b.args else None)
        if isinstance(ids, torch.Tensor) and ids_like(ids):
            longest = max(longest, int(ids.shape[-1]))
    return longest


def model_rejected(err: BaseException) -> bool:
    """Whether ``err``, raised by a model's forward, says the data does not fit the model (a shape, dtype or index
    the model cannot take, or an input it needs that the data does not give: ``None.shape``); running out of memory
    is not the data's fault."""
    if out_of_memory(err):
        return False
    if isinstance(err, AttributeError):  # (raised by the model's own code, not by qtool's hooks: a bug there)
        tb = err.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        inside_qtool = tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(_PACKAGE)
        return "'NoneType' object has no attribute" in str(err) and not inside_qtool
    return isinstance(err, (TypeError, RuntimeError, ValueError, IndexError, AssertionError))


_PACKAGE = Path(__file__).resolve().parent


def unpadded_rows(batch: Batch) -> List[Batch]:
    """``batch`` with the tokens its ``attention_mask`` drops left out: each row on its own, without its padding
    (a row it drops whole is no row), as a runtime that never pads sees the text; ``[batch]`` where it has no mask
    or keeps every token. A tensor of the mask's shape (ids, positions, token types), and ``inputs_embeds``, is cut
    as the mask is; any other (an image beside the text) keeps the row whole."""
    mask = batch.kwargs.get("attention_mask")
    if mask is None or mask.dim() != 2 or bool((mask > 0).all()):
        return [batch]
    shape = tuple(mask.shape)

    def row(t: torch.Tensor, r: int, keep: torch.Tensor, key: str = "") -> torch.Tensor:
        per_token = tuple(t.shape) == shape or (key == "inputs_embeds" and tuple(t.shape[:2]) == shape)
        return t[r:r + 1, keep] if per_token else t[r:r + 1]

    rows = []
    for r in range(shape[0]):
        keep = mask[r] > 0
        if bool(keep.any()):
            rows.append(Batch(tuple(row(a, r, keep) for a in batch.args),
                              {k: row(v, r, keep, k) for k, v in batch.kwargs.items()}))
    return rows


def batch_where(source: str, what: str, index: int) -> str:
    """How an error names a batch: ``calib.txt: calibration batch 3`` (the data's path, where known)."""
    return f"{source}: {what} batch {index}" if source else f"{what} batch {index}"


@contextlib.contextmanager
def model_takes(model, batch: "Batch", where: str) -> Iterator[None]:
    """Around a run of ``model`` on ``batch``: data it rejects (:func:`model_rejected`) is one ``DataError``,
    "``where``: the model rejected the data: " and :func:`rejection`'s reason; any other error stands."""
    try:
        yield
    except Exception as e:
        if not model_rejected(e):
            raise
        raise DataError(f"{where}: the model rejected the data: {rejection(model, batch, e)}") from None


def rejection(model, batch: "Batch", err: BaseException) -> str:
    """Why ``model`` rejected ``batch``, in one line: token ids past the model's vocabulary are named as such (the
    tokenizer belongs to another model), anything else is the error's first line."""
    ids = batch.kwargs.get("input_ids", batch.args[0] if batch.args else None)
    embed = getattr(model, "get_input_embeddings", None)
    try:
        table = embed() if callable(embed) else None
    except (NotImplementedError, AttributeError):
        table = None
    n = getattr(table, "num_embeddings", None)
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.numel() and isinstance(n, int):
        top, bottom = int(ids.max()), int(ids.min())
        if top >= n:
            return (f"token id {top} is past the model's vocabulary ({n} embeddings): the tokenizer (or the id file) "
                    "belongs to another model")
        if bottom < 0:
            return (f"token id {bottom} is negative (a padding marker such as -100 for labels?): ids run from 0 to "
                    f"{n - 1}; mask padding with attention_mask instead")
    # token ids saved as floats or narrow integers: torch's "Expected tensor for argument #1 'indices' to have one
    # of ... Long, Int"
    if isinstance(ids, torch.Tensor) and ids.dtype not in (torch.int64, torch.int32) \
            and isinstance(table, torch.nn.Embedding) and "indices" in str(err):
        held = str(ids.dtype).replace('torch.', '')
        if ids.is_floating_point():
            return (f"token ids must be integers, and the data holds {held} numbers: save them as integers (NumPy: "
                    "x.astype('int64'))")
        return (f"token ids must be int64 or int32, and the data holds {held}: save them as int64 (NumPy: "
                "x.astype('int64'))")
    tensors = [t for t in list(batch.args) + list(batch.kwargs.values()) if isinstance(t, torch.Tensor)]
    floats = {t.dtype for t in tensors if t.is_floating_point()}
    own = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if own is not None and floats - {own}:  # (NumPy's default float64 beside float32 weights: "mat1 and mat2 ...")
        other = sorted(str(d).replace("torch.", "") for d in floats - {own})[0]
        kind = str(own).replace("torch.", "")
        how = f"torch: x.to(torch.{kind}), saved as .safetensors or .pt" if own == torch.bfloat16 else \
            f"NumPy: x.astype('{kind}')"  # (NumPy has no bfloat16)
        return f"the data is {other} and the model {kind}: save the data as the model's type ({how})"
    # integer pixels (uint8 images) into a model with no embedding table: torch's "expected scalar type Byte but
    # found Float", "Input type (unsigned char) and bias type (float) should be the same"
    ints = sorted({str(t.dtype).replace("torch.", "") for t in tensors if not t.is_floating_point()})
    # (every input an integer tensor: a model that takes an integer side input beside float data is not this)
    if own is not None and table is None and tensors and all(not t.is_floating_point() and t.dtype != torch.bool
                                                             for t in tensors) and "type" in str(err):
        kind = str(own).replace("torch.", "")
        return (f"the data is {ints[0]} and the model {kind}, with no embedding table that takes integers: save the "
                f"data as the model's type (NumPy: x.astype('{kind}'); images scaled as the model was trained, such "
                "as x / 255)")
    config = getattr(model, "config", None)
    said = str(err).splitlines()[0] if str(err) else ""
    positions = positions_of(config)
    # a table of positions (rotary ones run on past the config's count); OPT's and BART's hold 2 rows more
    learned = positions is not None and any(
        isinstance(m, torch.nn.Embedding) and positions <= m.num_embeddings <= positions + 2
        and ("pos" in n.rsplit(".", 1)[-1] or n.endswith("wpe")) for n, m in model.named_modules())
    if learned and isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[-1] > positions:
        return (f"{ids.shape[-1]} tokens per sample are past the model's {positions} positions: pass --seq-len "
                f"{positions} or less for text, or save token samples of at most {positions}")
    if getattr(config, "is_encoder_decoder", False) and not any(k.startswith("decoder_") for k in batch.kwargs) \
            and "input_ids or inputs_embeds" in said:  # (T5's decoder found neither; BART makes its own)
        return (f"an encoder-decoder model ({type(model).__name__}) runs its decoder on decoder_input_ids, which the "
                f"data does not give (it gives {', '.join(batch.kwargs) or 'one tensor'}): pass a .safetensors file "
                "holding the encoder's inputs (input_ids, or a speech model's input_features) and "
                f"decoder_input_ids (the model said: {said})")
    if "input_ids or inputs_embeds" in said and batch.kwargs and "input_ids" not in batch.kwargs:
        return (f"the data's tensors are named {', '.join(batch.kwargs)}, and none is input_ids (np.savez without "
                "names writes arr_0, arr_1, ...): name them, e.g. np.savez(f, input_ids=ids, attention_mask=mask)")
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() == 1 \
            and isinstance(table, torch.nn.Embedding):
        return ("the token ids file has one dimension, so each sample is a single token: save ids as [samples, "
                f"tokens] (NumPy: x[None] for one sample; the model said: {said})")
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() > 2 \
            and isinstance(table, torch.nn.Embedding):  # (torch's "The size of tensor a (2) must match ...")
        return (f"the token ids file's samples are {list(ids.shape[1:])}, not one row of tokens each: save ids as "
                f"[samples, tokens] (NumPy: x.reshape(-1, x.shape[-1]); the model said: {said})")
    if isinstance(err, AttributeError):
        given = ", ".join(batch.kwargs) or "one tensor"
        return (f"it needs an input the data does not give (the data gives {given}; an image model takes "
                f"pixel_values, a speech model input_features): {str(err).splitlines()[0]}")
    return str(err).splitlines()[0] if str(err) else type(err).__name__
