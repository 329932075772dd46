"""The encodings file: :class:`EncodingsFile` (its entries and header, written as JSON with a sidecar for the
large ones, and read back, every field checked) and :class:`SidecarStream` (the sidecar written while
calibrating)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from ..config import OnlineRotation
from ..errors import EncodingsError
from ..io.jsonfile import dumps_indented, read_json_object
from ..quant.spec import Granularity
from .entry import EncodingEntry
from .schema import _RESERVED, INLINE_LIMIT, READS_VERSIONS, SCHEMA, SIDECAR, _inline
from .sidecar import _Sidecar


class SidecarStream:
    """Writes the sidecar while calibrating: the large entries are declared up front (their shapes are known
    from the plan) and each one's numbers go to disk as soon as it is calibrated, so the block min/max of a
    whole model are never all in memory. ``put`` returns the entry with its numbers replaced by meta tensors
    of the same shape; :meth:`EncodingsFile.write` then only writes the JSON for those."""

    def __init__(self, path: Path, shapes: List[Tuple[str, Tuple[int, ...], Granularity]],
                 inline_limit: int = INLINE_LIMIT):
        """``shapes``: (name, encoding shape, granularity) of every entry that may be put, in the order they come."""
        from ..io.st_writer import StreamingSafetensorsWriter

        self.inline_limit = inline_limit
        self.big = {name for name, shape, gran in shapes
                    if not _inline(math.prod(int(d) for d in shape), gran, inline_limit)}
        decl = [(f"{name}.{f}", dt, tuple(shape)) for name, shape, _ in shapes if name in self.big
                for f, dt in (("min", torch.float32), ("max", torch.float32), ("scale", torch.float32),
                              ("offset", torch.int32))]
        self.path = Path(path)
        self._writer = StreamingSafetensorsWriter(self.path, decl, metadata={"format": "pt", "schema": SCHEMA}) \
            if decl else None

    def put(self, entry: EncodingEntry) -> EncodingEntry:
        if entry.name not in self.big:
            return entry
        for key, t in entry.sidecar_tensors():
            self._writer.write(key, t)
        meta = torch.empty(tuple(entry.shape), device="meta")
        return dataclasses.replace(entry, min=meta, max=meta, source=None)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def abort(self) -> None:
        """Close without the every-tensor-written check (the run failed; its output directory is discarded)."""
        if self._writer is not None:
            self._writer.abort()


@dataclass
class EncodingsFile:
    entries: List[EncodingEntry]
    meta: Dict[str, Any]
    data_files: List[Path] = field(default_factory=list)  # sidecar files this was read from
    # file beside the JSON holding stored integer codes / updated float weights (qtool.weights), or None
    codes_file: Optional[str] = None
    # rotations of activations at run time (r4) the model must apply to compute what the encodings describe;
    # written as "online_rotations" (schema version 4: a reader that does not know them must refuse the file)
    online: List[OnlineRotation] = field(default_factory=list)

    def by_name(self) -> Dict[str, EncodingEntry]:
        return {e.name: e for e in self.entries}

    def _inline(self, e: EncodingEntry, inline_limit: Optional[int]) -> bool:
        return _inline(e.numel(), e.granularity, inline_limit)

    def _entry_json(self, e: EncodingEntry, inline_limit: Optional[int], arrays: bool = False) -> Dict[str, Any]:
        if self._inline(e, inline_limit):
            return e.to_json(arrays)
        return {**e.header_json(), "data": {
            "file": SIDECAR, **{f: f"{e.name}.{f}" for f in ("min", "max", "scale", "offset")}}}

    def _head(self, inline_limit: Optional[int]) -> Dict[str, Any]:
        version = 1 if all(self._inline(e, inline_limit) for e in self.entries) else 2
        meta = {k: v for k, v in self.meta.items() if k not in _RESERVED}
        if self.online:
            return {"schema": SCHEMA, "schema_version": 4, **meta,
                    **({"codes": {"file": self.codes_file}} if self.codes_file is not None else {}),
                    "online_rotations": [r.to_json() for r in self.online]}
        if self.codes_file is not None:
            return {"schema": SCHEMA, "schema_version": 3, **meta, "codes": {"file": self.codes_file}}
        return {"schema": SCHEMA, "schema_version": version, **meta}

    def to_json(self, inline_limit: Optional[int] = None) -> Dict[str, Any]:
        """The JSON object; entries above ``inline_limit`` numbers refer to the sidecar (None: all inline)."""
        return {**self._head(inline_limit), "quantizers": [self._entry_json(e, inline_limit) for e in self.entries]}

    def iter_dumps(self, inline_limit: Optional[int] = None) -> Iterator[str]:
        """The text of :meth:`dumps` piece by piece, one entry at a time: the same bytes as
        ``json.dumps(to_json(), indent=1) + "\\n"`` without holding every entry's numbers as Python objects at
        once (per-channel encodings of a multi-billion-parameter model are millions of them)."""
        head = json.dumps(self._head(inline_limit), indent=1, allow_nan=False)
        if not self.entries:
            yield head[:-2] + ',\n "quantizers": []\n}\n'
            return
        yield head[:-2] + ',\n "quantizers": [\n'  # head ends with "\n}"
        for i, e in enumerate(self.entries):
            try:
                text = dumps_indented(self._entry_json(e, inline_limit, arrays=True), 1, 2)
            except ValueError:  # NaN or an infinity: JSON cannot hold it, and qtool's reader would refuse it
                raise EncodingsError(f"{e.name}: its encoding holds NaN or infinity; nothing was written") from None
            yield ("" if i == 0 else ",\n") + "  " + text
        yield "\n ]\n}\n"

    def dumps(self, inline_limit: Optional[int] = None) -> str:
        return "".join(self.iter_dumps(inline_limit))

    def write(self, path: str | Path, inline_limit: Optional[int] = INLINE_LIMIT) -> List[Path]:
        """Write ``path`` (the JSON) and, when some entry is larger than ``inline_limit`` numbers, the sidecar
        ``encodings.safetensors`` beside it (streamed, one tensor at a time). Returns the files written."""
        from ..io.st_writer import StreamingSafetensorsWriter

        path = Path(path)
        big = [e for e in self.entries if not self._inline(e, inline_limit)]
        written = []
        streamed = [e for e in big if e.min.device.type == "meta" and e.source is None]
        if streamed:  # a SidecarStream wrote them while calibrating (and nothing else may be big)
            if len(streamed) != len(big):
                raise ValueError("some large entries were streamed to the sidecar and some were not")
            big = []
            written.append(path.parent / SIDECAR)
        if big:
            decl = [(f"{e.name}.{f}", dt, e.shape) for e in big
                    for f, dt in (("min", torch.float32), ("max", torch.float32), ("scale", torch.float32),
                                  ("offset", torch.int32))]
            with StreamingSafetensorsWriter(path.parent / SIDECAR, decl,
                                            metadata={"format": "pt", "schema": SCHEMA}) as w:
                for e in big:
                    for key, t in e.sidecar_tensors():
                        w.write(key, t)
            written.append(path.parent / SIDECAR)
        with open(path, "w", encoding="utf-8") as fh:
            for piece in self.iter_dumps(inline_limit):
                fh.write(piece)
        if self.codes_file is not None:
            written.append(path.parent / self.codes_file)
        return [path] + written

    def materialized(self) -> "EncodingsFile":
        """Every entry's numbers in memory (after a lazy :meth:`read`)."""
        return EncodingsFile([e.materialized() for e in self.entries], self.meta, self.data_files, self.codes_file,
                             self.online)

    @classmethod
    def read(cls, path: str | Path, lazy: bool = False) -> "EncodingsFile":
        """Read an encodings file. ``lazy``: entries kept in the sidecar are read when their numbers are asked
        for (``scale_offset``, ``range``, ``materialized``), one at a time, instead of all now."""
        path = Path(path)
        inside = next((f for f in (path / "encodings.json", path / "calibration" / "encodings.json") if f.is_file()),
                      None) if path.is_dir() else None
        if inside is not None:  # (a calibrate run, or a quantize/export output with its calibration beside it)
            raise EncodingsError(f"{path}: is a directory; the encodings file is {inside}: pass that")
        obj = read_json_object(path, EncodingsError, "encodings file", strict=True)
        if obj.get("schema") != SCHEMA:
            hint = " (an AIMET file: qtool import-encodings turns it into one)" if path.name.endswith(".encodings") \
                else ""
            raise EncodingsError(f"{path}: not a qtool encodings file (expected \"schema\": \"{SCHEMA}\"){hint}")
        version = obj.get("schema_version")
        if version not in READS_VERSIONS or isinstance(version, bool):
            raise EncodingsError(
                f"{path}: schema_version {version!r} is not supported (this qtool reads "
                f"{', '.join(map(str, READS_VERSIONS))})"
            )
        raw = obj.get("quantizers")
        if not isinstance(raw, list):
            raise EncodingsError(f"{path}: 'quantizers' must be a list")
        sidecar = _Sidecar(path) if version >= 2 else None
        entries = [EncodingEntry.from_json(e, f"{path}: quantizers[{i}]", sidecar, lazy) if isinstance(e, dict)
                   else _bad_entry(path, i) for i, e in enumerate(raw)]
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            seen = set()
            dup = next(n for n in names if n in seen or seen.add(n))
            raise EncodingsError(f"{path}: quantizer {dup!r} appears twice")
        meta = {k: v for k, v in obj.items() if k not in _RESERVED}
        if version < 4 and "online_rotations" in obj:
            raise EncodingsError(f"{path}: 'online_rotations' needs schema_version 4 (this file says {version})")
        online = _read_online(obj.get("online_rotations"), path) if version >= 4 else []
        kv = {e.module for e in entries if e.tensor == "k_cache"}
        for i, rot in enumerate(online):
            bare = next((m for m in rot.modules if m not in kv), None) if rot.location == "k_cache" else None
            if bare is not None:  # r3 rotates what a KV cache quantizer sees: without one it means nothing
                raise EncodingsError(f"{path}: online_rotations[{i}]: {bare!r} has no quantized KV cache (no "
                                     "k_cache quantizer in this file) for its key rotation")
        codes_file = None
        data_files = [] if sidecar is None else sidecar.files()
        if version >= 3 and obj.get("codes") is not None:
            codes = obj["codes"]
            name = codes.get("file") if isinstance(codes, dict) else None
            if not isinstance(name, str) or not name or Path(name).name != name:
                raise EncodingsError(f"{path}: 'codes' must be {{\"file\": NAME}} naming a file beside the JSON")
            if not (path.parent / name).is_file():
                raise EncodingsError(f"{path.parent / name}: codes file not found (named by {path})")
            codes_file = name
            data_files.append(path.parent / name)
        return cls(entries, meta, data_files, codes_file, online)


def calibration_manifest(enc_path: Path) -> Tuple[Optional[Dict[str, Any]], str]:
    """``(the manifest.json beside enc_path, "")``; ``(None, "")`` where there is none; ``(None, the reader's one
    line)`` for a damaged one."""
    manifest = Path(enc_path).parent / "manifest.json"
    if not manifest.is_file():
        return None, ""
    try:
        return read_json_object(manifest, EncodingsError, "calibration manifest"), ""
    except EncodingsError as e:
        return None, str(e)


def recorded_elsewhere(recorded: Optional[Dict[str, Any]], hashes: Optional[Iterable[str]]) -> Optional[str]:
    """The checkpoint path a calibration manifest ``recorded`` names where its weight-file sha256 are not
    ``hashes`` (None: the same weights, no weights recorded, or nothing to compare)."""
    if recorded is None or hashes is None:
        return None
    try:
        checkpoint = recorded["inputs"]["checkpoint"]
        then = sorted(str(h) for h in checkpoint["sha256"].values())
    except (KeyError, TypeError, AttributeError):
        return None
    return str(checkpoint.get("path", "another checkpoint")) if then and then != sorted(hashes) else None


def weights_not_compared(enc_path: Path, checkpoint: str, why: str = "") -> str:
    """What is said where no calibration manifest lies beside ``enc_path`` (``why``: a damaged one's reader line,
    where it is let through) to compare the weights the encodings were made on with ``checkpoint``'s."""
    return (f"{why or f'no manifest.json beside {enc_path}'}: the weights the encodings were made on are not "
            f"compared with {checkpoint}'s (encodings applied to other weights clip or waste their grids)")


def refuse_damaged_manifest(why: str) -> None:
    """A damaged manifest (``calibration_manifest``'s reason) is refused: read as "no record", it let encodings
    meet other weights without a word."""
    raise EncodingsError(f"{why}; it records the weights the encodings were made on: restore it, or pass "
                         "--allow-other-checkpoint to apply the encodings unchecked")


def calibrated_elsewhere(enc_path: Path, hashes: Optional[Iterable[str]], checkpoint: str,
                         unreadable_ok: bool = False) -> Tuple[Optional[str], Optional[str]]:
    """Encodings are applied to the weights they were calibrated on: ``(the path the calibration's manifest.json
    beside enc_path records, where its checkpoint's weight-file sha256 are not hashes, the line that says nothing
    was compared, where no readable manifest lies there)``; ``(None, None)`` for the same weights, or ``hashes``
    None (``io.checkpoint.weight_file_hashes`` of no weight files: nothing to compare). ``hashes`` are
    ``checkpoint``'s, the one given now: other bytes, whatever its path. Ranges from another model of the same
    shape clip or waste its grid. A damaged manifest is refused unless ``unreadable_ok`` (--allow-other-checkpoint,
    or a note at most): read as "no record", it let encodings meet other weights without a word."""
    if hashes is None:
        return None, None
    recorded, why = calibration_manifest(enc_path)
    if why and not unreadable_ok:
        refuse_damaged_manifest(why)
    if recorded is None:
        return None, weights_not_compared(enc_path, checkpoint, why)
    return recorded_elsewhere(recorded, hashes), None


def _read_online(raw: Any, path: Path) -> List[OnlineRotation]:
    """The ``online_rotations`` list of a version-4 file, each checked (the modules they name are checked against
    the model when the encodings are applied)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise EncodingsError(f"{path}: 'online_rotations' must be a list")
    out, seen = [], set()
    for i, r in enumerate(raw):
        where = f"{path}: online_rotations[{i}]"
        if not isinstance(r, dict) or set(r) != {"name", "type", "seed", "location", "modules"}:
            raise EncodingsError(f"{where}: must be an object with name, type, seed, location and modules")
        mods = r["modules"]
        if r["type"] not in ("hadamard", "random-hadamard"):
            raise EncodingsError(f"{where}: type {r['type']!r} is not hadamard or random-hadamard")
        if r["location"] not in ("input", "k_cache"):
            raise EncodingsError(f"{where}: location {r['location']!r} is not supported (input, k_cache)")
        if not isinstance(r["seed"], int) or isinstance(r["seed"], bool) or not 0 <= r["seed"] < 2**63:
            raise EncodingsError(f"{where}: seed must be an integer from 0 to 2^63-1")
        if not isinstance(r["name"], str) or not r["name"]:
            raise EncodingsError(f"{where}: name must be a non-empty string")
        if not isinstance(mods, list) or not mods or not all(isinstance(m, str) and m for m in mods):
            raise EncodingsError(f"{where}: modules must be a non-empty list of module names")
        twice = next((m for m in mods if m in seen or seen.add(m)), None)
        if twice is not None:
            raise EncodingsError(f"{where}: module {twice!r} is rotated twice")
        if any(o.name == r["name"] for o in out):  # exporters name a transform after it (compressed-tensors' R4)
            raise EncodingsError(f"{where}: name {r['name']!r} is used twice")
        out.append(OnlineRotation(r["name"], r["type"], r["seed"], tuple(mods), r["location"]))
    return out


def _bad_entry(path, i):
    raise EncodingsError(f"{path}: quantizers[{i}] must be an object")
