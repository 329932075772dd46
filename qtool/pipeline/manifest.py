"""A run's manifest (``manifest.json``): what command ran with which versions, on which inputs (with their
sha256), and what it wrote (with theirs). One builder for every job that writes one (calibrate, export,
import-encodings), so the record reads the same everywhere; keys a job adds follow in its own order."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

from ..io.fs import sha256_file
from ..provenance import versions


def manifest(command: str, inputs: Dict[str, Any], outputs: Dict[str, str], *, head: Optional[Dict[str, Any]] = None,
             device: Optional[str] = None, options: Optional[Dict[str, Any]] = None,
             tail: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``{"command", **head, "versions", "device", "options", "inputs", "outputs", **tail}`` (``device`` and
    ``options`` only where given)."""
    return {"command": command, **(head or {}), "versions": versions(),
            **({"device": device} if device is not None else {}), **({"options": options} if options is not None else {}),
            "inputs": inputs, "outputs": outputs, **(tail or {})}


def write_manifest(directory: Path, record: Dict[str, Any]) -> Path:
    """``directory/manifest.json``: one space of indent, values JSON cannot hold written as text."""
    path = directory / "manifest.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return path


def digests(files: Iterable[Path], key=str) -> Dict[str, str]:
    """``{key(file): sha256}``."""
    return {key(f): sha256_file(f) for f in files}


def checkpoint_input(checkpoint: str, sha256: Dict[str, str], kind: Optional[str] = None,
                     hub: bool = True) -> Dict[str, Any]:
    """The checkpoint's entry in ``inputs``: its path, kind (where known), every weight file's sha256
    (:func:`digests`) and, for a checkpoint fetched from the Hugging Face Hub, where from."""
    return {"path": str(os.fspath(checkpoint)), **({"kind": kind} if kind is not None else {}), "sha256": sha256,
            **(_hub(checkpoint) if hub else {})}


def _hub(checkpoint) -> Dict[str, Any]:
    """``{"hub": {repo_id, revision, commit}}`` for a checkpoint resolved from a Hugging Face Hub ID, else {}."""
    from ..model.hub import origin

    found = origin(checkpoint)
    return {"hub": found} if found else {}
