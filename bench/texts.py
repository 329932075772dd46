"""The texts every SmolLM2 accuracy benchmark calibrates on and scores on, in one place.

* calibration: 300 paragraphs of Python's documentation (``pydoc_data.topics``);
* held out, the calibration text's kind: 300 other paragraphs of it;
* held out, other kinds (never used to choose anything): CPython's ``LICENSE.txt`` (legal English) and IDLE's
  2.x change log ``idlelib/NEWS2x.txt`` (terse bug-report English), both shipped with every CPython
  installation, so the benchmarks run offline. A distribution that leaves one out (some split ``idlelib`` into
  its own package) scores on the others; ``held_out_texts`` says which.
* for choosing a setting (``selection_text``), a fourth text of another kind that no table scores: IDLE's notes
  (``idlelib/README.txt``, ``TODO.txt``, ``extend.txt``, ``CREDITS.txt``: informal developer English). A sweep
  picks its value on this text, then reports the two texts above, which chose nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Tuple

DOCS = "python docs (held out)"
LICENSE = "CPython LICENSE (another kind)"
CHANGELOG = "IDLE change log (another kind)"
_STDLIB = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
OTHER_KINDS = {LICENSE: _STDLIB / "LICENSE.txt", CHANGELOG: _STDLIB / "idlelib" / "NEWS2x.txt"}
SELECTION = "IDLE notes (another kind, for choosing)"
SELECTION_SOURCES = [_STDLIB / "idlelib" / name for name in ("README.txt", "TODO.txt", "extend.txt", "CREDITS.txt")]
SHORT = {DOCS: "docs", LICENSE: "LICENSE", CHANGELOG: "NEWS2x", SELECTION: "notes*"}  # table headers


def _installed_other_kinds() -> Dict[str, Path]:
    """``{name: source}`` of the texts of other kinds this Python has; says which it lacks."""
    found = {}
    for name, source in OTHER_KINDS.items():
        if source.is_file():
            found[name] = source
        else:
            print(f"note: {source} is not installed here; {name!r} is left out of the scores", file=sys.stderr)
    return found


def held_out_texts(tmp: Path) -> Tuple[Path, Dict[str, Path]]:
    """Writes the calibration text and every held-out text under ``tmp``; returns the calibration file and
    ``{name: file}`` of the held-out ones (the calibration text's kind first)."""
    from qtool.example import text_split

    calib, held = text_split(300, 300)
    (tmp / "calib.txt").write_text("\n\n".join(calib))
    (tmp / "docs.txt").write_text("\n\n".join(held))
    texts = {DOCS: tmp / "docs.txt"}
    for i, (name, source) in enumerate(_installed_other_kinds().items()):
        texts[name] = tmp / f"other{i}.txt"
        texts[name].write_text(source.read_text(encoding="utf-8"))
    return tmp / "calib.txt", texts


def selection_text(tmp: Path) -> Path:
    """Writes the text a sweep chooses its setting on (IDLE's notes, joined) under ``tmp``; returns the file."""
    missing = [str(p) for p in SELECTION_SOURCES if not p.is_file()]
    if missing:
        raise SystemExit(f"the selection text needs {', '.join(missing)}, which this Python does not have")
    out = tmp / "selection.txt"
    out.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in SELECTION_SOURCES))
    return out


def batches(path: Path, tokenizer, windows: int, seq_len: int = 256) -> List:
    """``windows`` packed windows of ``seq_len`` tokens of ``path``, in batches of 8 (seed 0)."""
    from qtool.data import load_data

    return list(load_data(path, batch_size=8, seq_len=seq_len, tokenizer=tokenizer, pack_text=True,
                          num_samples=windows, seed=0))


def paragraphs(n_calib: int = 128, n_held: int = 128) -> Tuple[List[str], Dict[str, List[str]]]:
    """For sentence-embedding models: ``n_calib`` calibration paragraphs of the docs and ``{name: paragraphs}`` of
    every held-out text (``n_held`` at most each; the other kinds' paragraphs are their blank-line-separated
    blocks of more than 80 characters, whitespace joined, as the docs' are)."""
    from qtool.example import text_split

    calib, held = text_split(n_calib, n_held)
    out = {DOCS: held}
    for name, source in _installed_other_kinds().items():
        blocks = (" ".join(b.split()) for b in source.read_text(encoding="utf-8").split("\n\n"))
        out[name] = [b for b in blocks if len(b) > 80][:n_held]
    return calib, out


def header(names) -> str:
    return " / ".join(SHORT.get(n, n) for n in names)
