"""Hugging Face Hub model IDs as checkpoints: ``qtool quantize HuggingFaceTB/SmolLM2-135M ...``.

A checkpoint argument that is not an existing path but looks like ``org/name`` is fetched with
``huggingface_hub.snapshot_download`` into the Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``), which honours
``HF_HUB_OFFLINE`` (cache only) and a token from the usual places (``HF_TOKEN``, ``huggingface-cli login``). Only
what qtool reads is downloaded: configs, safetensors weights, tokenizer files. The resolved snapshot directory is
then an ordinary Hugging Face directory; :func:`origin` tells the manifest writer which repository and commit it
came from.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Dict, Optional

from ..errors import CheckpointError, UsageError

__all__ = ["resolve_checkpoint", "origin", "looks_like_hub_id"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
# what qtool reads from a model repository (no pickled *.bin weights, no remote code)
_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_ORIGINS: Dict[str, Dict[str, str]] = {}


def looks_like_hub_id(arg: str) -> bool:
    return bool(_HUB_ID.match(arg)) and not arg.endswith((".safetensors", ".pt", ".pt2", ".pth", ".bin"))


def resolve_checkpoint(arg: str, revision: Optional[str] = None) -> str:
    """A local checkpoint path for ``arg``: the path itself when it exists, else the Hub snapshot of the
    repository ``arg`` names (downloaded into the cache, or found there offline). Raises ``CheckpointError`` with
    one line saying what was tried."""
    if isinstance(arg, os.PathLike):  # (a path as every job takes it)
        arg = os.fspath(arg)
    if not isinstance(arg, str):
        raise UsageError(f"the checkpoint is a path or a Hub ID string (got {type(arg).__name__})")
    if revision is not None and not isinstance(revision, str):
        raise UsageError(f"revision is a branch, tag or commit string (got {type(revision).__name__})")
    if not arg.strip():  # (Path("") is the working directory)
        raise UsageError("CHECKPOINT is empty: pass a file, a directory or a Hugging Face Hub ID like org/name")
    if revision is not None and not revision.strip():  # (the Hub's cache reads refs/ itself: "Is a directory")
        raise UsageError("--revision is empty: pass a branch, a tag or a commit, or leave it out for main")
    if Path(arg).exists():
        if revision is not None:
            raise UsageError(f"--revision applies to a Hugging Face Hub ID; {arg} is a local path")
        return arg
    if not looks_like_hub_id(arg):
        raise CheckpointError(f"{arg}: checkpoint not found (no such file or directory, and not a Hugging Face Hub ID "
                              "like org/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise UsageError(f"{arg}: is not a local path; to load it from the Hugging Face Hub install the hf extra "
                         "(pip install 'qtool[hf]')") from None
    try:
        local = snapshot_download(arg, revision=revision, allow_patterns=_PATTERNS)
    except GatedRepoError:
        raise CheckpointError(f"{arg}: gated on the Hugging Face Hub: accept its terms and log in "
                              "(HF_TOKEN or `hf auth login`)") from None
    except RevisionNotFoundError:
        raise CheckpointError(f"{arg}: revision {revision!r} not found on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{arg}: {_not_local(arg)}no such model on the Hugging Face Hub (or it is private: log "
                              "in with HF_TOKEN or `hf auth login`)") from None
    except LocalEntryNotFoundError:
        what = "" if revision is None else f"revision {revision!r} "
        raise CheckpointError(f"{arg}: {_not_local(arg)}{what}not in the Hugging Face cache, and the Hub cannot be "
                              "reached (HF_HUB_OFFLINE set, or no network); download it once online, or pass a local "
                              "directory") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{arg}: could not fetch from the Hugging Face Hub: {str(e).splitlines()[0]}") from None
    _ORIGINS[str(local)] = {"repo_id": arg, "revision": revision or "main", "commit": Path(local).name}
    return str(local)


def _not_local(arg: str) -> str:
    """What to say first when a Hub ID is also a path whose directory exists here (a mistyped local path)."""
    parent = Path(arg).parent
    return f"no such file or directory in {parent}, and " if str(parent) != "." and parent.is_dir() else ""


def origin(path) -> Optional[Dict[str, str]]:
    """``{repo_id, revision, commit}`` when ``path`` is a Hub snapshot that :func:`resolve_checkpoint` resolved."""
    return _ORIGINS.get(str(path))
